"""Every RPC of the aggregator fed what a hostile member could send: generated messages and raw bytes.

Requests are generated from each method's input DESCRIPTOR (`messages`: ints at their extremes, nan and inf,
unicode and huge strings, long repeated fields, nested messages, enum numbers the schema does not define, and
strings the consortium knows, such as the round in flight) or as raw bytes, mutated serializations included
(`raw_messages`), and sent over mutual TLS to a live aggregator whose round waits at its first secure-sum
stage, or, for most of the slow run's inputs, handed to the same servicers in-process (`in_process`). For
every input the status code must be one `EXPECTED` allows for the method (never INTERNAL, nor UNKNOWN, which
is what an uncaught exception in a handler becomes), a refusal must name its problem, and a refused request
must leave the store exactly as it was.

Crashes this found and the fixes they led to are pinned by the regression tests at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import queue
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aggregator import server
from aggregator.catalog import CATALOG
from aggregator.config import load_consortium_config
from aggregator.service import CertificateGate, OperatorServicer
from aggregator.store import DATABASE
from aggregator.studies import Studies, StudyRouter
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, operator_pb2, operator_pb2_grpc, round_pb2
from tests.consortium_harness import Consortium, channel, read_all, register

CODE = grpc.StatusCode
FUZZ_EXAMPLES = 30  # per handler and kind of input (generated messages, raw bytes), over the wire by default
IN_PROCESS_EXAMPLES = 10  # per handler and kind, in-process by default
SLOW_FUZZ_EXAMPLES = 10_000  # per handler in-process with -m slow, half generated messages, half raw bytes
SLOW_WIRE_EXAMPLES = 1_000  # per handler over the wire with -m slow, likewise
CALL_SECONDS = 30.0  # no call should come near it; a hang shows up as DEADLINE_EXCEEDED, which no one expects
ROUND_SECONDS = 4 * 3600.0  # the round in flight outlasts the slowest fuzzing run
MAX_RECEIVE = 4 * 2**20  # gRPC's default cap on one received message: larger is RESOURCE_EXHAUSTED
HUGE = 2**18  # the longest generated string or bytes value, in repeats of up to 4 characters
RARE = 16  # one value in RARE is huge, one repeated field in RARE long (where `huge` allows)

SERVICES = (
    pb.DESCRIPTOR.services_by_name["ConsortiumService"],
    operator_pb2.DESCRIPTOR.services_by_name["OperatorService"],
)
METHODS: dict[str, MethodDescriptor] = {m.name: m for service in SERVICES for m in service.methods}
# Who calls: silo-0 takes part in the round in flight and keeps its directive stream open throughout; Join
# replaces the caller's stream, so silo-2 (invited too, its stream expendable) fuzzes it; the operator calls
# every RPC of the operator's service.
CALLER = {"Join": "silo-2", **{m.name: "operator" for m in SERVICES[1].methods}}
OPEN_ENDED = {"Join"}  # streams that last as long as the session: one response shows the call was taken
# The codes a request that parses may get, with the reason each is right for this consortium (secagg, round
# waiting for keys, caller silo-0). A request that does not parse is INVALID_ARGUMENT; one over gRPC's size
# cap is RESOURCE_EXHAUSTED (`expected_codes`).
EXPECTED: dict[str, frozenset[grpc.StatusCode]] = {
    # a registration naming only what silo policies may hold is kept; anything else is refused
    "Register": frozenset({CODE.OK, CODE.INVALID_ARGUMENT}),
    # JoinRequest carries nothing the aggregator reads
    "Join": frozenset({CODE.OK}),
    # refused only for an activity number the schema does not define
    "Heartbeat": frozenset({CODE.OK, CODE.INVALID_ARGUMENT}),
    # the round in flight's state, or no such round
    "FetchState": frozenset({CODE.OK, CODE.FAILED_PRECONDITION}),
    # no upload is due while the sum waits for keys
    "Submit": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    # a refusal of the attempt in flight from an invited silo, in one printable line; else refused
    "Refuse": frozenset({CODE.OK, CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    # fedavg asks no silo for a disclosure
    "Disclose": frozenset({CODE.FAILED_PRECONDITION, CODE.PERMISSION_DENIED}),
    # no key set is signed by silo-0's key; other stages are not open
    "AdvertiseKeys": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    "ShareKeys": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    "Consistency": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    "Unmask": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    # no installed layer declares dataclass messages, so no Send carries one the aggregator reads
    "Send": frozenset({CODE.INVALID_ARGUMENT}),
    # secagg asks for no key service: its calls are refused, whatever they carry
    "ListEnrollments": frozenset({CODE.FAILED_PRECONDITION}),
    "ShareKey": frozenset({CODE.FAILED_PRECONDITION}),
    "FetchKey": frozenset({CODE.FAILED_PRECONDITION}),
    "FetchSum": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION}),
    # a state report that parses still names no round whose sum silo-0 was counted in
    "ReportState": frozenset({CODE.INVALID_ARGUMENT, CODE.FAILED_PRECONDITION, CODE.PERMISSION_DENIED}),
    "ReportEvaluation": frozenset({CODE.FAILED_PRECONDITION}),
    # the default study (no id, or its own), an id no study has, or a string no study id can be
    "Status": frozenset({CODE.OK, CODE.NOT_FOUND, CODE.INVALID_ARGUMENT}),
    # a study file that passes the aggregator's checks is queued (the fuzzer's silos never join it); an id
    # taken by an earlier example exists already; anything else is refused, listing its problems
    "CreateStudy": frozenset({CODE.OK, CODE.ALREADY_EXISTS, CODE.INVALID_ARGUMENT}),
    "ListStudies": frozenset({CODE.OK}),
    # only a study an earlier example created can be found, and then its state decides; the known strings
    # hold no default study's id, so the round in flight runs on
    "PauseStudy": frozenset({CODE.OK, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION, CODE.INVALID_ARGUMENT}),
    "ResumeStudy": frozenset({CODE.OK, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION, CODE.INVALID_ARGUMENT}),
    "CancelStudy": frozenset({CODE.OK, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION, CODE.INVALID_ARGUMENT}),
}


# --- generated messages, from any message's descriptor ----------------------------------------------

_INT_RANGES: dict[int, tuple[int, int]] = {
    **dict.fromkeys(
        (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32),
        (-(2**31), 2**31 - 1),
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64),
        (-(2**63), 2**63 - 1),
    ),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32), (0, 2**32 - 1)),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64), (0, 2**64 - 1)),
}


# Values worth sending (the round in flight, silo ids): string fields draw from its strings, bytes from bytes.
Known = tuple[str | bytes, ...]


class Recipe(ABC):
    """How to make a value, drawn in its place and made by `build` in the test: Hypothesis keeps every value
    it draws for the rest of the test, and the huge ones took gigabytes over thousands of inputs."""

    @abstractmethod
    def build(self) -> object: ...


def build(value: object) -> object:
    """`value` with every `Recipe` in it (in lists too) made."""
    if isinstance(value, Recipe):
        return value.build()
    if isinstance(value, list):
        return [build(item) for item in value]
    return value


@dataclass(frozen=True)
class Repeated(Recipe):
    """`item` `times` times: one str or bytes (`joined`), or a list of copies."""

    item: object
    times: int
    joined: bool

    def build(self) -> object:
        item = build(self.item)
        return item * self.times if self.joined else [item] * self.times


@dataclass(frozen=True)
class Made(Recipe):
    """A message of type `cls` with `fields` (by name; values are built too)."""

    cls: type[Message]
    fields: tuple[tuple[str, object], ...]

    def build(self) -> Message:
        message = self.cls()
        for name, value in self.fields:
            made, field = build(value), self.cls.DESCRIPTOR.fields_by_name[name]
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                _put_entries(getattr(message, name), made, field.message_type.fields_by_name["value"])
            elif field.is_repeated:
                getattr(message, name).extend(made)
            elif field.message_type is not None:
                getattr(message, name).CopyFrom(made)
            else:
                setattr(message, name, made)
        return message


def _put_entries(container, entries: list[Message], value: FieldDescriptor) -> None:
    """A map field from its drawn entries (key and value messages): a later key replaces an earlier one."""
    for entry in entries:
        if value.message_type is not None:
            container[entry.key].CopyFrom(entry.value)
        else:
            container[entry.key] = entry.value


@dataclass(frozen=True)
class Serialized(Recipe):
    """A message's bytes, with `extra` bytes after them."""

    message: Recipe
    extra: bytes = b""

    def build(self) -> bytes:
        return self.message.build().SerializeToString() + self.extra


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Any value in the field's range, its extremes and the values next to zero more often."""
    edges = sorted({low, low + 1, -1 if low < 0 else 0, 0, 1, high - 1, high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def _huge(alphabet: st.SearchStrategy, join: Callable) -> st.SearchStrategy[Repeated]:
    """A short pattern repeated up to `HUGE` times: huge values for what little drawing they cost."""
    pattern = st.lists(alphabet, min_size=1, max_size=4).map(join)
    return st.builds(Repeated, pattern, st.integers(1000, HUGE), st.just(True))


def _rarely(common: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """`common`, or once in `RARE` draws `rare`: huge values cost time on the wire, and a few suffice."""
    return st.one_of(*[common] * (RARE - 1), rare)


def _scalar(field: FieldDescriptor, known: Known, huge: bool) -> st.SearchStrategy:
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()  # nan, ±inf, -0.0 and subnormals included
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        defined = sorted(field.enum_type.values_by_number)
        return st.one_of(st.sampled_from(defined), _integers(-(2**31), 2**31 - 1))
    if kind == FieldDescriptor.TYPE_STRING:
        common, pattern, join, of = st.text(), st.characters(codec="utf-8"), "".join, str
    elif kind == FieldDescriptor.TYPE_BYTES:
        common, pattern, join, of = st.binary(), st.binary(min_size=1, max_size=1), b"".join, bytes
    else:
        raise AssertionError(f"no strategy for {field.full_name} of type {kind}")
    same = [value for value in known if isinstance(value, of)]
    common = st.one_of(common, st.sampled_from(same)) if same else common
    return _rarely(common, _huge(pattern, join)) if huge else common


def _value(field: FieldDescriptor, known: Known, huge: bool, depth: int) -> st.SearchStrategy:
    if field.message_type is not None:
        return messages(field.message_type, known, huge=huge, depth=depth + 1)
    return _scalar(field, known, huge)


def _field(field: FieldDescriptor, known: Known, huge: bool, depth: int) -> st.SearchStrategy:
    """A field's value: a few elements of a repeated field, or (`huge`) one element repeated up to 10,000
    times, drawn without `huge`: 10,000 copies of a message holding 10,000 of another took gigabytes."""
    if not field.is_repeated:
        return _value(field, known, huge, depth)
    few = st.lists(_value(field, known, huge, depth), max_size=6)
    if not huge:
        return few
    many = st.builds(Repeated, _value(field, known, False, depth), st.integers(64, 10_000), st.just(False))
    return _rarely(few, many)


def _made(cls: type[Message], values: dict[str, object]) -> Made:
    """The recipe of a message from a draw of its fields, where a oneof's is (the field chosen, its value)."""
    return Made(
        cls, tuple(value if isinstance(value, tuple) else (name, value) for name, value in values.items())
    )


@functools.cache  # building a strategy costs more than drawing from it
def messages(
    descriptor: Descriptor, known: Known = (), *, huge: bool = True, depth: int = 0
) -> st.SearchStrategy[Made]:
    """(The recipe of) any message of `descriptor`'s type: each field set or not, at most one field of each
    oneof (proto3 optional fields are one-field oneofs), strings and bytes sometimes from `known`. `huge`
    allows values up to `HUGE` long and repeated fields up to 10,000 long (`_field`)."""
    if depth > 8:
        return st.just(Made(GetMessageClass(descriptor), ()))
    optional: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        if field.containing_oneof is None:
            optional[field.name] = _field(field, known, huge, depth)
    for oneof in descriptor.oneofs:
        optional[oneof.name] = st.one_of(
            *(st.tuples(st.just(f.name), _field(f, known, huge, depth)) for f in oneof.fields)
        )
    return st.builds(
        _made, st.just(GetMessageClass(descriptor)), st.fixed_dictionaries({}, optional=optional)
    )


# --- raw bytes ---------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def mutated(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    """`data` with bytes overwritten at `edits` (positions wrap around) and cut short at `cut`."""
    out = bytearray(data)
    for position, byte in edits:
        if out:
            out[position % len(out)] = byte
    return bytes(out if cut is None else out[: cut % (len(out) + 1)])


def _bad_utf8(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """A string field of the message holding bytes that are not UTF-8, which proto3 parsers refuse."""
    numbers = [f.number for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING]
    if not numbers:
        return st.nothing()
    invalid = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
    return st.builds(
        lambda number, text, prefix: _varint(number << 3 | 2) + _varint(len(prefix + text)) + prefix + text,
        st.sampled_from(numbers),
        invalid,
        st.binary(max_size=8),
    )


def _unknown_fields() -> st.SearchStrategy[bytes]:
    """Well-formed fields of numbers no message here defines, as a newer peer may send: parsers keep them."""
    number = st.integers(100, 18_999) | st.integers(20_000, 2**29 - 1)  # 19000-19999 are protobuf's own
    field = st.one_of(
        st.builds(lambda n, v: _varint(n << 3) + _varint(v), number, st.integers(0, 2**64 - 1)),
        st.builds(lambda n, v: _varint(n << 3 | 1) + v, number, st.binary(min_size=8, max_size=8)),
        st.builds(lambda n, v: _varint(n << 3 | 2) + _varint(len(v)) + v, number, st.binary()),
        st.builds(lambda n, v: _varint(n << 3 | 5) + v, number, st.binary(min_size=4, max_size=4)),
    )
    return st.lists(field, min_size=1, max_size=3).map(b"".join)


@functools.cache  # building a strategy costs more than drawing from it
def encoded(descriptor: Descriptor, known: Known = (), *, huge: bool = True) -> st.SearchStrategy[Serialized]:
    """A generated message serialized, half of the time with unknown fields after it."""
    extra = st.one_of(st.just(b""), _unknown_fields())
    return st.builds(Serialized, messages(descriptor, known, huge=huge), extra)


@functools.cache  # building a strategy costs more than drawing from it
def raw_messages(descriptor: Descriptor, known: Known = ()) -> st.SearchStrategy[bytes]:
    """Bytes for a message of `descriptor`'s type: random, valid ones mutated or cut short, invalid UTF-8."""
    edits = st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=4)
    return st.one_of(
        st.binary(max_size=256),
        st.builds(
            lambda base, edits, cut: mutated(base.build(), edits, cut),
            encoded(descriptor, known, huge=False),  # small: what is drawn is kept
            edits,
            st.none() | st.integers(0, 2**16),
        ),
        _bad_utf8(descriptor),
    )


# --- requests of one method, as the bytes that go on the wire ----------------------------------------


@dataclass(frozen=True)
class Described(Recipe):
    """A client stream whose header (field `header`, in both client streams) names the size and SHA-256 of
    the chunks after it, so the aggregator reads past its checks of the header."""

    head: Recipe
    tail: list

    def build(self) -> list[bytes]:
        parts = [self.head.build(), *build(self.tail)]
        payload = b"".join(p.chunk for p in parts[1:] if p.WhichOneof("part") == "chunk")
        header = parts[0].header
        header.total_bytes, header.sha256 = len(payload), hashlib.sha256(payload).hexdigest()
        return [p.SerializeToString() for p in parts]


@functools.cache  # building a strategy costs more than drawing from it
def requests(method: MethodDescriptor, known: Known, *, raw: bool) -> st.SearchStrategy[Recipe]:
    """(The recipe of) one request (a list of one), or a client stream's parts, as bytes; `raw`: mostly
    bytes that need not parse."""
    one = raw_messages(method.input_type, known) if raw else encoded(method.input_type, known)
    if not method.client_streaming:
        return st.builds(Parts, st.tuples(one).map(list))
    cls = GetMessageClass(method.input_type)
    header = messages(method.input_type.fields_by_name["header"].message_type, known).map(
        lambda h: Made(cls, (("header", h),))
    )
    described = st.builds(Described, header, st.lists(messages(method.input_type, known), max_size=5))
    streams = st.one_of(st.builds(Parts, st.lists(encoded(method.input_type, known), max_size=6)), described)
    if not raw:
        return streams
    loose = st.builds(Parts, st.lists(st.one_of(one, encoded(method.input_type, known)), max_size=6))
    return st.one_of(loose, st.builds(Parts, st.lists(st.one_of(streams, loose), min_size=2, max_size=2)))


@dataclass(frozen=True)
class Parts(Recipe):
    """A request's parts: bytes, or recipes of bytes or of lists of them (one after the other)."""

    parts: list

    def build(self) -> list[bytes]:
        made = [build(part) for part in self.parts]
        return [piece for part in made for piece in (part if isinstance(part, list) else [part])]


def _parses(method: MethodDescriptor, data: bytes) -> bool:
    try:
        GetMessageClass(method.input_type).FromString(data)
    except DecodeError:
        return False
    return True


def expected_codes(method: MethodDescriptor, parts: list[bytes]) -> frozenset[grpc.StatusCode]:
    """What the aggregator may answer: a part over gRPC's cap or that does not parse ends the call there, but
    in a client stream the handler may refuse what came before such a part first."""
    codes = EXPECTED[method.name]
    for number, part in enumerate(parts):
        first = number == 0 or not method.client_streaming
        if len(part) > MAX_RECEIVE:
            return frozenset({CODE.RESOURCE_EXHAUSTED}) | (frozenset() if first else codes)
        if not _parses(method, part):
            return frozenset({CODE.INVALID_ARGUMENT}) | (frozenset() if first else codes)
    if method.client_streaming and not parts:
        return frozenset({CODE.INVALID_ARGUMENT})  # a stream starts with a header
    return codes


# --- the consortium under fuzzing --------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str


def invoke(ch: grpc.Channel, method: MethodDescriptor, parts: list[bytes]) -> Outcome:
    """Call `method` with bytes as they are (no serializer): requests that do not parse reach the server."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            ch.stream_unary(path)(iter(parts), timeout=CALL_SECONDS)
        elif not method.server_streaming:
            ch.unary_unary(path)(parts[0], timeout=CALL_SECONDS)
        elif method.name in OPEN_ENDED:
            responses = ch.unary_stream(path)(parts[0], timeout=CALL_SECONDS)
            next(responses)
            responses.cancel()
        else:
            for _ in ch.unary_stream(path)(parts[0], timeout=CALL_SECONDS):
                pass
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "")
    return Outcome(CODE.OK, "")


def store_digest(path: Path) -> str:
    """SHA-256 over every row of every table, read-only. Every column counts: while the round waits, only a
    request the aggregator accepts may write (Register and Heartbeat do)."""
    digest = hashlib.sha256()
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        tables = [
            r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        ]
        for table in tables:
            digest.update(table.encode())
            for row in db.execute(f'SELECT * FROM "{table}" ORDER BY rowid'):
                for value in row:
                    encoded = value if isinstance(value, bytes) else repr(value).encode()
                    digest.update(len(encoded).to_bytes(8, "big") + encoded)
    return digest.hexdigest()


@dataclass
class Fuzzed:
    """A live aggregator with a secagg round in flight: its silos' directive streams, the callers' channels,
    and the strings worth using in requests (the round's id, silo ids, names policies use)."""

    consortium: Consortium
    channels: dict[str, grpc.Channel]
    known: Known
    directives: dict[str, queue.Queue]
    unchanged: str = ""  # the store's digest after the last refusal, when nothing was accepted since
    aborted: set[str] = dataclasses.field(default_factory=set)  # attempts an accepted refusal has ended

    def digest(self) -> str:
        return store_digest(self.consortium.data_dir / DATABASE)


SILOS = ("silo-0", "silo-1", "silo-2")


def _consortium(tmp_path_factory) -> Consortium:
    """Three secagg silos, all needed for a round, whose round outlasts the fuzzing."""
    directory = tmp_path_factory.mktemp("fuzz")
    return Consortium.create(directory, rounds=1, min_silos=3, silos=3, round_timeout=ROUND_SECONDS)


def _known(first: pb.JoinResponse) -> Known:
    """What is worth sending, from the round's first directive: its RoundSpec."""
    spec = round_pb2.RoundSpec.FromString(first.round_spec.spec)
    return (spec.round_id, *spec.participants, spec.method, spec.privacy, "plaintext", "ckks", "mfsc")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> Iterator[Fuzzed]:
    consortium = _consortium(tmp_path_factory)
    consortium.start_aggregator()
    channels = {name: channel(consortium, name) for name in (*SILOS, "operator")}
    streams, directives = [], {}
    try:
        for silo in SILOS:
            register(channels[silo])
            directives[silo] = queue.Queue()
            streams.append(consortium_pb2_grpc.ConsortiumServiceStub(channels[silo]).Join(pb.JoinRequest()))
            threading.Thread(target=read_all, args=(streams[-1], directives[silo]), daemon=True).start()
        yield Fuzzed(consortium, channels, _known(directives["silo-0"].get(timeout=120)), directives)
    finally:
        for stream in streams:
            stream.cancel()
        for ch in channels.values():
            ch.close()
        consortium.stop()


def check(rpc: str, parts: list[bytes], outcome: Outcome) -> None:
    """An expected code, and a refusal that says why."""
    allowed = expected_codes(METHODS[rpc], parts)
    assert outcome.code in allowed, f"{rpc}: {outcome.code.name} ({outcome.details!r}); expected {allowed}"
    if outcome.code != CODE.OK:
        assert outcome.details, outcome
        assert "internal error" not in outcome.details, outcome


def fuzz_once(fuzzed: Fuzzed, rpc: str, parts: list[bytes]) -> None:
    """One request over the wire: `check`, and no write from a refused request."""
    before = fuzzed.unchanged or fuzzed.digest()
    fuzzed.unchanged = ""
    outcome = invoke(fuzzed.channels[CALLER.get(rpc, "silo-0")], METHODS[rpc], parts)
    check(rpc, parts, outcome)
    if outcome.code != CODE.OK:
        assert fuzzed.digest() == before, f"{rpc} refused ({outcome}) but wrote to the store"
        fuzzed.unchanged = before
    elif rpc == "Refuse":
        await_abort(fuzzed, pb.RefuseRequest.FromString(parts[0]).round_id)


def await_abort(fuzzed: Fuzzed, round_id: str) -> None:
    """An accepted refusal leaves the round short of its floor (every silo is needed): the driver thread
    aborts the attempt, writing to the store after the call returned. The Abort directive goes out after that
    write, so once silo-0 holds it the store is still again (the refusal stands for the round's timeout, so no
    new attempt begins); without this wait the write landed in the next request's check, at random. A
    refusal of the attempt already aborted is kept and answered OK with no new abort: waiting for one hung
    (the slow run's one failure of issue 35's stop)."""
    if round_id in fuzzed.aborted:
        return
    while fuzzed.directives["silo-0"].get(timeout=120).WhichOneof("directive") != "abort":
        pass
    fuzzed.aborted.add(round_id)


# --- the same in-process, where most of the slow run's inputs go ---------------------------------------
# Over the wire, an input costs two to four times its generation (TLS, gRPC, the store's digest): 10,000 per
# handler took 1.5 to 6 minutes each, 51 in all; in-process, 45 s to 5 min, 22 in all (busy 2-core machine).
# In-process, the servicers serve() built are called behind the same gate with what gRPC would hand them:
# parsed parts (`Context` stands in for its ServicerContext), and whether a refused request wrote is the
# store connection's change count. gRPC's own 4 MiB cap stays over the wire.


class Aborted(Exception):
    """`context.abort` in-process: the status a handler ends its call with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """What the handlers ask of gRPC's ServicerContext, for a caller holding the certificate `pem`."""

    def __init__(self, pem: bytes) -> None:
        self.pem = pem
        self.active = True
        self.callbacks: list[Callable[[], object]] = []

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self.pem]}

    def invocation_metadata(self) -> tuple:
        return ()  # no study named: the default study's, as the fuzzed silos' calls over the wire

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback: Callable[[], object]) -> bool:
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        """The call is over: gRPC runs the callbacks its handler added."""
        self.active = False
        for callback in self.callbacks:
            callback()


def call(
    handler: grpc.RpcMethodHandler, method: MethodDescriptor, parts: list[bytes], context: Context
) -> Outcome:
    """One call as gRPC makes it of `handler`: parse each part, run it, serialize its responses; an exception
    that escapes the handler is UNKNOWN, as in gRPC. An open-ended stream ends after its first response."""
    requests = map(handler.request_deserializer, parts)
    try:
        if method.client_streaming:
            responses = [handler.stream_unary(requests, context)]
        elif not method.server_streaming:
            responses = [handler.unary_unary(next(requests), context)]
        else:
            stream = handler.unary_stream(next(requests), context)
            responses = [next(stream)] if method.name in OPEN_ENDED else list(stream)
            stream.close()
        for response in responses:
            handler.response_serializer(response)
    except Aborted as exc:
        return Outcome(exc.code, exc.details)
    except Exception as exc:
        return Outcome(CODE.UNKNOWN, f"{type(exc).__name__}: {exc}")
    finally:
        context.end()
    return Outcome(CODE.OK, "")


class _Registry:
    """Takes the method handlers a servicer registers, as a gRPC server would."""

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        (self.generic,) = handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        pass


def _gated(gate: grpc.ServerInterceptor, servicer: object, add: Callable) -> dict[str, grpc.RpcMethodHandler]:
    """The servicer's handler of each of its methods, behind the gate, by method name."""
    registry = _Registry()
    add(servicer, registry)
    handlers = {}
    for name, method in METHODS.items():
        details = SimpleNamespace(
            method=f"/{method.containing_service.full_name}/{name}", invocation_metadata=()
        )
        handler = gate.intercept_service(registry.generic.service, details)
        if handler is not None:
            handlers[name] = handler
    return handlers


@dataclass
class InProcess:
    handlers: dict[str, grpc.RpcMethodHandler]
    pems: dict[str, bytes]  # each caller's certificate
    watched: tuple[sqlite3.Connection, ...]  # the default study's store and the study catalog, read only
    known: Known

    def changes(self) -> tuple[int, ...]:
        """Each watched file's SQLite data_version, which moves with every commit another connection makes
        to it: whatever wrote, and also after an accepted request paused or cancelled the default study
        (which closes its store's own connection; reading that connection's count then failed)."""
        return tuple(db.execute("PRAGMA data_version").fetchone()[0] for db in self.watched)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Iterator[InProcess]:
    """`serve` in this process, its servicers and gate taken as it builds them; once its studies started
    (before that, a silo's call finds the default study queued), silos register and join in-process too,
    and their directive streams stay open until the end."""
    consortium = _consortium(tmp_path_factory)
    built: dict[str, object] = {}
    started = threading.Event()

    def taken(cls: type) -> type:
        class Taken(cls):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                built[cls.__name__] = self

        return Taken

    class Started(Studies):
        def start(self) -> None:
            super().start()
            started.set()

    stop = threading.Event()
    config = load_consortium_config(consortium.directory / "consortium.toml")
    with pytest.MonkeyPatch.context() as patch:
        for cls in (StudyRouter, OperatorServicer, CertificateGate):
            patch.setattr(server, cls.__name__, taken(cls))
        patch.setattr(server, "Studies", Started)
        serving = threading.Thread(
            target=server.serve, args=(config,), kwargs={"stop": stop, "echo": lambda *_: None}
        )
        serving.start()
        assert started.wait(120), "serve() did not start its studies"
    gate = built["CertificateGate"]
    handlers = {
        **_gated(gate, built["StudyRouter"], consortium_pb2_grpc.add_ConsortiumServiceServicer_to_server),
        **_gated(gate, built["OperatorServicer"], operator_pb2_grpc.add_OperatorServiceServicer_to_server),
    }
    pki = consortium.directory / "pki"
    pems = {name: (pki / f"{name}.pem").read_bytes() for name in (*SILOS, "operator")}
    sessions = {silo: Context(pems[silo]) for silo in SILOS}
    directives: queue.Queue = queue.Queue()
    try:
        registration = pb.RegisterRequest(agent_version="fedlt-tests/0").SerializeToString()
        for silo, context in sessions.items():
            registered = call(handlers["Register"], METHODS["Register"], [registration], Context(pems[silo]))
            assert registered.code == CODE.OK, registered
            stream = handlers["Join"].unary_stream(pb.JoinRequest(), context)
            threading.Thread(target=read_all, args=(stream, directives), daemon=True).start()
        known = _known(directives.get(timeout=120))
        files = (consortium.data_dir / DATABASE, consortium.data_dir / CATALOG)
        watched = tuple(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) for path in files)
        yield InProcess(handlers, pems, watched, known)
    finally:
        for context in sessions.values():
            context.end()
        stop.set()
        serving.join(60)


def fuzz_in_process(ip: InProcess, rpc: str, parts: list[bytes]) -> None:
    """One request in-process: `check`, and no write from a refused request."""
    assume(all(len(part) <= MAX_RECEIVE for part in parts))  # gRPC refuses those before any handler
    before = ip.changes()
    outcome = call(ip.handlers[rpc], METHODS[rpc], parts, Context(ip.pems[CALLER.get(rpc, "silo-0")]))
    check(rpc, parts, outcome)
    if outcome.code != CODE.OK:
        assert ip.changes() == before, f"{rpc} refused ({outcome}) but wrote to the store"


def draw_parts(data: st.DataObject, rpc: str, known: Known, raw: bool) -> list[bytes]:
    return build(data.draw(requests(METHODS[rpc], known, raw=raw), label="parts"))


FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("raw", [False, True], ids=["messages", "raw"])
@pytest.mark.parametrize("rpc", METHODS)
@FUZZ
@given(data=st.data())
def test_every_rpc_refuses_hostile_requests_precisely_and_writes_nothing(fuzzed, rpc, raw, data):
    fuzz_once(fuzzed, rpc, draw_parts(data, rpc, fuzzed.known, raw))


@pytest.mark.parametrize("raw", [False, True], ids=["messages", "raw"])
@pytest.mark.parametrize("rpc", METHODS)
@settings(FUZZ, max_examples=IN_PROCESS_EXAMPLES)
@given(data=st.data())
def test_every_handler_in_process_refuses_hostile_requests_precisely_and_writes_nothing(
    in_process, rpc, raw, data
):
    """Keeps the in-process harness of the slow run honest."""
    fuzz_in_process(in_process, rpc, draw_parts(data, rpc, in_process.known, raw))


@pytest.mark.slow
@pytest.mark.parametrize("raw", [False, True], ids=["messages", "raw"])
@pytest.mark.parametrize("rpc", METHODS)
@settings(FUZZ, max_examples=SLOW_FUZZ_EXAMPLES // 2, derandomize=False)
@given(data=st.data())
def test_every_handler_under_ten_thousand_hostile_requests(in_process, rpc, raw, data):
    fuzz_in_process(in_process, rpc, draw_parts(data, rpc, in_process.known, raw))


@pytest.mark.slow
@pytest.mark.parametrize("raw", [False, True], ids=["messages", "raw"])
@pytest.mark.parametrize("rpc", METHODS)
@settings(FUZZ, max_examples=SLOW_WIRE_EXAMPLES // 2, derandomize=False)
@given(data=st.data())
def test_every_rpc_under_a_thousand_hostile_requests_over_the_wire(fuzzed, rpc, raw, data):
    fuzz_once(fuzzed, rpc, draw_parts(data, rpc, fuzzed.known, raw))


# --- crashes the fuzzing found, pinned ---------------------------------------------------------------


def test_a_request_that_does_not_parse_is_refused_not_an_internal_error(fuzzed):
    """It was INTERNAL ("Exception deserializing request!"), from inside gRPC, before any handler ran."""
    not_utf8 = b"\x0a\x02\xc3\x28"  # HeartbeatRequest.round_id holding bytes that are not UTF-8
    outcome = invoke(fuzzed.channels["silo-0"], METHODS["Heartbeat"], [not_utf8])
    assert outcome.code == CODE.INVALID_ARGUMENT
    assert "the request does not parse" in outcome.details
    assert "fedlt.v1.HeartbeatRequest" in outcome.details


def test_a_stream_part_that_does_not_parse_is_refused_naming_the_part(fuzzed):
    header = pb.ReportStateRequest(header=pb.StateReportHeader(total_bytes=4, evaluation_kind=1))
    parts = [header.SerializeToString(), b"\x12\x04ab"]  # the chunk announces 4 bytes and holds 2
    outcome = invoke(fuzzed.channels["silo-0"], METHODS["ReportState"], parts)
    assert outcome.code == CODE.INVALID_ARGUMENT
    assert "part 2 of the stream does not parse" in outcome.details


def test_a_refusal_quoting_a_huge_value_still_reaches_the_caller(fuzzed):
    """Quoted whole, the round id outgrew the status trailer: the caller got RESOURCE_EXHAUSTED ("received
    metadata size exceeds soft limit") instead of the refusal."""
    request = pb.FetchStateRequest(round_id="é" * 5000).SerializeToString()
    before = fuzzed.digest()
    outcome = invoke(fuzzed.channels["silo-0"], METHODS["FetchState"], [request])
    assert outcome.code == CODE.FAILED_PRECONDITION
    assert outcome.details.startswith("no attempt 'éé")
    assert outcome.details.endswith("… (cut)")
    assert fuzzed.digest() == before


def test_a_reflection_stream_part_that_does_not_parse_is_refused_too(fuzzed):
    """The gate parses for the stock services as well; reflection's stream was INTERNAL, then UNKNOWN."""
    call = fuzzed.channels["silo-0"].stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    )
    list_services = b"\x3a\x00"
    with pytest.raises(grpc.RpcError) as refused:
        list(call(iter([list_services, b"\x0a\x01\xff"]), timeout=CALL_SECONDS))
    assert refused.value.code() == CODE.INVALID_ARGUMENT
    assert "part 2 of the stream does not parse" in refused.value.details()
