"""Thin gRPC servicers over a study's round inbox (the silos' calls) and the aggregator's studies (the
operator's): who is calling (from the certificate), and status codes.

A caller's silo id or operator name is read from its client certificate (verified by TLS against the
consortium CA, checked here against the revocation list), never from a message field; `CertificateGate`
applies the same check to every RPC of the server, health and reflection included. Requests are checked where
they enter: enum numbers the schema does not define, registrations naming what no policy can hold, empty or
endless uploads, study ids no study can have. Every refusal maps to a status code in one table, `STATUS_OF`;
anything unexpected becomes INTERNAL without leaking details to the caller.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from aggregator.catalog import (
    BadStudy,
    StudyControl,
    StudyError,
    StudyExists,
    StudyInfo,
    UnknownStudy,
    WrongState,
)
from aggregator.held_state import StateReport
from aggregator.inbox import RoundInbox
from aggregator.key_service import KeyServiceRelay, NoKeyService
from aggregator.picking import BadDisclosure
from aggregator.round_table import AlreadySubmitted, BadContribution, NotParticipant, Refusal, WrongRound
from aggregator.store import Store, now_ms
from fedlt.aggregation.halves import BadMessage, SumAborted
from fedlt.aggregation.registry import RegistryError
from fedlt.errors import ContributionError, FedltError
from fedlt.methods import METHODS
from fedlt.selection import DISCLOSURE
from fedlt.studies import id_problems
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, operator_pb2, operator_pb2_grpc
from fedlt.wire import PURPOSE_OF_SUM, chunks, schema_from_pb
from privacy.keyservice.ceremony import Announcement
from privacy.keyservice.wire import enrollment_to_pb, sealed_from_pb, sealed_to_pb
from privacy.pki.errors import PkiError
from privacy.pki.identity import (
    MemberTrust,
    RevocationList,
    describe,
    load_certificate,
    operator_name_of,
    silo_id_of,
)
from privacy.pki.roster import RosterFile
from privacy.stepping.attestation import Attestation, NotAttested, check_report
from privacy.wire import (
    WireError,
    consortium_layers,
    payload_kinds,
    received,
    receivers,
    submitted,
    upload_of,
    upload_type,
)

log = logging.getLogger("aggregator.service")

AGENT_VERSION_CHARS = 64
ROUND_ID_CHARS = 64  # "r<round>.a<attempt>.<nonce>" fits with room to spare
REFUSAL_TEXT_CHARS = 512  # a refusal's text, one printable line (the silo cuts its own to fit)
STATE_LIMIT = 2**31  # bytes of a sealed state a silo may report
STUDY_FILE_BYTES = 2**20  # a study file's text, UTF-8; a plan is a few KiB
# Bytes of a refusal's message in the status trailer, percent-encoded: clients drop trailers over 8 KiB.
DETAILS_BYTES = 2048
# What a silo's policy may name, from the tables that define each kind; the messages list these keys.
POLICY_CHOICES: dict[str, tuple[str, ...]] = {
    "accepted_methods": tuple(METHODS),
    "accepted_privacy": consortium_layers(),
    "accepted_disclosures": (DISCLOSURE,),
}

M = TypeVar("M", bound=Message)


class Malformed(Refusal):
    """A malformed request (wrong order of stream parts, sizes that do not add up, undefined enum numbers)."""


class BadRegistration(Refusal):
    """A registration whose agent version or policy lists hold values no silo agent sends."""


class TooSlow(Refusal):
    """A client stream outlasted the aggregator's own bound on it."""


class Cancelled(Refusal):
    """The RPC ended while its stream was being read: the caller cancelled it, or gRPC did."""


class Unauthenticated(Refusal):
    """No client certificate reached the handler."""


class Revoked(Refusal):
    """The client certificate is on the consortium's revocation list."""


class NotRegistered(Refusal):
    """A silo joined before registering."""


STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    WrongRound: grpc.StatusCode.FAILED_PRECONDITION,
    NotRegistered: grpc.StatusCode.FAILED_PRECONDITION,
    NotParticipant: grpc.StatusCode.PERMISSION_DENIED,
    Revoked: grpc.StatusCode.PERMISSION_DENIED,
    PkiError: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    BadContribution: grpc.StatusCode.INVALID_ARGUMENT,
    Malformed: grpc.StatusCode.INVALID_ARGUMENT,
    BadRegistration: grpc.StatusCode.INVALID_ARGUMENT,
    TooSlow: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cancelled: grpc.StatusCode.CANCELLED,
    AlreadySubmitted: grpc.StatusCode.ALREADY_EXISTS,
    BadMessage: grpc.StatusCode.INVALID_ARGUMENT,
    SumAborted: grpc.StatusCode.FAILED_PRECONDITION,
    ContributionError: grpc.StatusCode.INVALID_ARGUMENT,
    BadDisclosure: grpc.StatusCode.INVALID_ARGUMENT,
    NoKeyService: grpc.StatusCode.FAILED_PRECONDITION,
    UnknownStudy: grpc.StatusCode.NOT_FOUND,
    StudyExists: grpc.StatusCode.ALREADY_EXISTS,
    BadStudy: grpc.StatusCode.INVALID_ARGUMENT,
    WrongState: grpc.StatusCode.FAILED_PRECONDITION,
    StudyError: grpc.StatusCode.FAILED_PRECONDITION,  # any other study request that cannot be done as asked
}


def _refuse(context: grpc.ServicerContext, exc: Exception, where: str) -> None:
    """Abort with the code `STATUS_OF` gives the refusal; anything else is a bug: logged, and INTERNAL."""
    for kind, code in STATUS_OF.items():
        if isinstance(exc, kind):
            context.abort(code, _within_trailer(str(exc)))
    log.error("unexpected error in %s", where, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, "internal error; see the aggregator's log")


def _within_trailer(details: str, budget: int = DETAILS_BYTES) -> str:
    """`details` cut to `budget` bytes as gRPC percent-encodes them into the grpc-message trailer.

    A refusal may quote the caller (a round id it named); quoted whole, a long value makes the trailer
    outgrow the client's metadata limit, and the caller sees RESOURCE_EXHAUSTED without the reason.
    """
    used = 0
    for end, char in enumerate(details):
        used += 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "replace"))
        if used > budget:
            return details[:end] + " … (cut)"
    return details


def _abort_on_refusal(handler: Callable) -> Callable:
    """Check every request message's enums, then map refusals to status codes; for streaming handlers this
    wraps the generator too, and for streaming requests each message as the handler reads it."""

    def fail(context: grpc.ServicerContext, exc: Exception) -> None:
        _refuse(context, exc, handler.__name__)

    @functools.wraps(handler)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            checked = _known_enums(request) if isinstance(request, Message) else map(_known_enums, request)
            result = handler(self, checked, context)
        except Exception as exc:
            fail(context, exc)
        if not isinstance(result, Iterator):
            return result
        return _guarded(result, context, fail)

    return unary


def _guarded(stream: Iterator, context: grpc.ServicerContext, fail: Callable) -> Iterator:
    try:
        yield from stream
    except Exception as exc:
        fail(context, exc)


def _known_enums(message: M) -> M:
    """Refuse enum numbers the schema does not define, in any field at any depth.

    proto3 enums are open: an unknown number parses and stays a plain int, and a handler that names it
    (`SiloActivity.Name(99)`) would fail with an internal error instead of refusing the caller. A map field
    (a layer's generic message) is checked by its values.
    """
    problems = list(_unknown_enums(message, message.DESCRIPTOR.name))
    if problems:
        raise Malformed("; ".join(problems))
    return message


def _unknown_enums(message: Message, where: str) -> Iterator[str]:
    for field, value in message.ListFields():
        path = f"{where}.{field.name}"
        values = value if field.is_repeated else [value]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            field, values = field.message_type.fields_by_name["value"], list(value.values())
        if field.enum_type is not None:
            known = field.enum_type.values_by_number
            yield from (
                f"{path}: {number} is not a {field.enum_type.name} "
                f"(known: {', '.join(known[n].name for n in sorted(known))})"
                for number in values
                if number not in known
            )
        elif field.message_type is not None:
            for item in values:
                yield from _unknown_enums(item, path)


def _registration_problems(request: pb.RegisterRequest) -> list[str]:
    """Every reason to refuse a registration; what passes is shown to the operator and kept in the store."""
    problems = []
    version = request.agent_version
    if not version:
        problems.append("agent_version: empty")
    elif len(version) > AGENT_VERSION_CHARS:
        problems.append(f"agent_version: {len(version)} characters; at most {AGENT_VERSION_CHARS}")
    elif not version.isprintable():
        problems.append("agent_version: not printable")
    for name, allowed in POLICY_CHOICES.items():
        counts = Counter(getattr(request, name))
        unknown = [_shown(value) for value in counts if value not in allowed]
        repeated = [f"{_shown(value)} {n} times" for value, n in counts.items() if n > 1]
        if unknown:
            problems.append(f"{name}: unknown {_first(unknown)}; allowed: {', '.join(allowed)}")
        if repeated:
            problems.append(f"{name}: repeats {_first(repeated)}")
    return problems


def _refusal_problems(request: pb.RefuseRequest) -> list[str]:
    """Every reason to refuse a refusal: it is shown to the operator and kept in the audit log, so only one
    short printable line, for a named attempt, with a code, is taken."""
    problems = []
    if not request.round_id:
        problems.append("round_id: empty")
    elif len(request.round_id) > ROUND_ID_CHARS or not request.round_id.isprintable():
        problems.append(f"round_id: {_shown(request.round_id)} is no attempt's id")
    if request.code == pb.REFUSAL_CODE_UNSPECIFIED:
        problems.append("code: unspecified; name the reason's kind (policy, data, ...)")
    if not request.text.strip():
        problems.append("text: empty; say why")
    elif len(request.text) > REFUSAL_TEXT_CHARS:
        problems.append(f"text: {len(request.text)} characters; at most {REFUSAL_TEXT_CHARS}")
    elif not request.text.isprintable():
        problems.append("text: not one printable line")
    return problems


def _code_name(code: int) -> str:
    """A RefusalCode as the operator reads it: `REFUSAL_CODE_POLICY` is "policy"."""
    return pb.RefusalCode.Name(code).removeprefix("REFUSAL_CODE_").lower()


def _shown(value: str, limit: int = 32) -> str:
    """A caller's string in a refusal, cut short: a refusal does not echo a huge request back."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


def _first(items: list[str], count: int = 3) -> str:
    more = f" and {len(items) - count} more" if len(items) > count else ""
    return ", ".join(items[:count]) + more


def _within(parts: Iterator[M], seconds: float, context: grpc.ServicerContext) -> Iterator[M]:
    """A client stream's parts, cut off with TooSlow after `seconds`, even while the client sends nothing.

    gRPC has no server-side deadline, and a handler blocked on the next part cannot be interrupted, so the
    parts are read on a helper thread and handed over through a short queue (which keeps gRPC's flow control:
    the helper reads at most two parts ahead). The helper ends with the RPC; an RPC that ends early (the
    caller cancelled, gRPC refused an oversized message) ends the wait within a second, with Cancelled.
    """
    handover: queue.Queue = queue.Queue(maxsize=2)
    threading.Thread(
        target=_hand_over, args=(parts, handover, context), name="client-stream", daemon=True
    ).start()
    until = time.monotonic() + seconds
    while True:
        left = until - time.monotonic()
        if left <= 0:
            raise TooSlow(f"this stream took longer than the {seconds:g} s the aggregator allows")
        try:
            part, error = handover.get(timeout=min(left, 1.0))
        except queue.Empty:
            if not context.is_active():
                raise Cancelled("the RPC ended before its stream did") from None
            continue
        if error is not None:
            raise error
        if part is None:
            return
        yield part


def _hand_over(parts: Iterator, handover: queue.Queue, context: grpc.ServicerContext) -> None:
    """Runs on the helper thread of `_within`: (part, None) for each part, then (None, error or None)."""
    end: tuple[None, Exception | None] = (None, None)
    try:
        for part in parts:
            if not _offer(handover, (part, None), context):
                return
    except Exception as exc:  # raised again on the handler's thread
        end = (None, exc)
    _offer(handover, end, context)


def _offer(handover: queue.Queue, item: tuple, context: grpc.ServicerContext) -> bool:
    while context.is_active():
        try:
            handover.put(item, timeout=1.0)
        except queue.Full:
            continue
        return True
    return False


class Identity:
    """Reads the verified peer certificate and refuses revoked ones; the CRL is re-read when it changes."""

    def __init__(self, revocations: RevocationList) -> None:
        self.revocations = revocations

    def certificate(self, context: grpc.ServicerContext) -> Any:
        pems = context.auth_context().get("x509_pem_cert")
        if not pems:
            raise Unauthenticated("a consortium client certificate is required")
        cert = load_certificate(pems[0])
        self.revocations.reload()
        if self.revocations.is_revoked(cert):
            raise Revoked("this certificate has been revoked by the consortium operator")
        return cert

    def silo(self, context: grpc.ServicerContext) -> str:
        return silo_id_of(self.certificate(context))


_HANDLER_OF: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class CertificateGate(grpc.ServerInterceptor):
    """Runs `Identity.certificate` before every RPC of the server, health and reflection included.

    The fedlt servicers read the certificate themselves (they need the caller's id); the stock services do
    not, so without the gate a revoked member could still learn which services run and whether they serve.
    An interceptor sees no ServicerContext, so the check runs in a wrapper of the method's behaviour, which
    gRPC calls with one.

    The gate also parses the request: bytes that are no message of the method's type (truncated, invalid
    UTF-8 in a string) would otherwise fail inside gRPC, which answers INTERNAL as if the aggregator were at
    fault. They reach the wrapper as `Undecodable` and are refused with INVALID_ARGUMENT, naming the problem.
    """

    def __init__(self, identity: Identity) -> None:
        self.identity = identity

    def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # no such method: UNIMPLEMENTED tells nothing the published .proto files do not
        kind = next(kind for kind in _HANDLER_OF if getattr(handler, kind) is not None)
        behaviour = getattr(handler, kind)

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                self.identity.certificate(context)
                request = _decoded_parts(request) if handler.request_streaming else _decoded(request)
            except (Unauthenticated, Revoked, PkiError) as exc:
                _log_refused(context, handler_call_details.method, exc)
                _refuse(context, exc, handler_call_details.method)
            except Exception as exc:
                _refuse(context, exc, handler_call_details.method)
            if not handler.request_streaming:
                return behaviour(request, context)
            # the fedlt servicers refuse an undecodable part themselves; the stock ones (reflection) would not
            try:
                result = behaviour(request, context)
            except UndecodablePart as exc:
                _refuse(context, exc, handler_call_details.method)
            return _refusing_undecodable(result, context) if handler.response_streaming else result

        return _HANDLER_OF[kind](
            checked,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def _log_refused(context: grpc.ServicerContext, what: str, exc: Exception) -> None:
    """The operator's line for a caller refused for who it is, naming its address and certificate (gRPC's
    own lines for a failed TLS handshake name neither)."""
    pems = context.auth_context().get("x509_pem_cert")
    try:
        presented = describe(load_certificate(pems[0])) if pems else "no client certificate"
    except PkiError:
        presented = "a certificate that does not parse"
    log.warning("refused %s from %s, which presented %s: %s", what, context.peer(), presented, exc)


class Undecodable:
    """Request bytes the method's deserializer refused, handed on so the refusal is the gate's, not gRPC's."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, returning `Undecodable` instead of raising (gRPC would answer INTERNAL)."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError from protobuf; any deserializer's failure means the same
            return Undecodable((str(exc) or type(exc).__name__)[:200])

    return parse


def _decoded(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise Malformed(f"the request does not parse: {request.problem}")
    return request


class UndecodablePart(Malformed):
    """A part of a client stream that does not parse."""


def _decoded_parts(parts: Iterator) -> Iterator:
    """A client stream's parts; the first one that does not parse ends the stream with UndecodablePart."""
    for number, part in enumerate(parts, 1):
        if isinstance(part, Undecodable):
            raise UndecodablePart(f"part {number} of the stream does not parse: {part.problem}")
        yield part


def _refusing_undecodable(responses: Iterator, context: grpc.ServicerContext) -> Iterator:
    try:
        yield from responses
    except UndecodablePart as exc:
        _refuse(context, exc, "a client stream")


class ConsortiumServicer(consortium_pb2_grpc.ConsortiumServiceServicer):
    """`members` admits the roster's silos; `roster` and the CRL go to every silo that registers, which
    checks its peers with them;
    `submit_seconds` bounds one Submit stream on the aggregator's side (`serve` gives it the round's timeout,
    after which no contribution is accepted anyway)."""

    def __init__(
        self,
        inbox: RoundInbox,
        store: Store,
        identity: Identity,
        aggregator_pem: bytes,
        *,
        members: MemberTrust,
        roster: RosterFile,
        relay: KeyServiceRelay | None,
        submit_seconds: float,
    ) -> None:
        self.inbox = inbox
        self.store = store
        self.identity = identity
        self.aggregator_pem = aggregator_pem
        self.members = members
        self.roster = roster
        self.relay = relay
        self.submit_seconds = submit_seconds
        self._rosters_held: dict[str, str] = {}  # silo -> body digest of the roster its last heartbeat named

    @property
    def _layer(self) -> str:
        """The consortium's layer: what silos send is read as its messages, never another layer's."""
        return self.inbox.config.consortium.privacy

    @_abort_on_refusal
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        cert = self.identity.certificate(context)
        silo = silo_id_of(cert)
        problems = _registration_problems(request)
        if problems:
            raise BadRegistration("registration refused: " + "; ".join(problems))
        policy = {
            "methods": list(request.accepted_methods),
            "privacy": list(request.accepted_privacy),
            "disclosures": list(request.accepted_disclosures),
        }
        pem = context.auth_context()["x509_pem_cert"][0]
        try:
            self.members.silo(pem, silo)  # one the CA issued but the roster does not name is no member
        except PkiError as exc:
            _log_refused(context, "a registration", exc)
            raise
        self.store.register_silo(silo, hashlib.sha256(pem).hexdigest(), request.agent_version, policy)
        reply = pb.RegisterResponse(
            silo_id=silo,
            consortium_id=self.inbox.config.consortium.id,
            aggregator_certificate=self.aggregator_pem,
            roster=self.roster.raw(),
            crl=self.identity.revocations.current()[0],
        )
        if self.relay is not None:  # a silo enrolls for any layer its policy lists: kept only if one is run
            if request.HasField("key_enrollment"):  # checked by the key holder, which seals to roster silos
                enrollment = request.key_enrollment
                self.relay.enroll(Announcement(silo, enrollment.public_key, enrollment.signature, pem))
            reply.key_holder, reply.key_layer = self.relay.key_holder, self.relay.layer
        return reply

    @_abort_on_refusal
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Iterator[pb.JoinResponse]:
        silo = self.identity.silo(context)
        if silo not in self.store.silos():
            raise NotRegistered("call Register before Join")
        session = self.inbox.connect(silo)
        context.add_callback(lambda: self.inbox.disconnect(session))
        return self._directives(session, context)

    def _directives(self, session: Any, context: grpc.ServicerContext) -> Iterator[pb.JoinResponse]:
        while context.is_active() and not session.closed:
            try:
                directive = session.directives.get(timeout=1.0)
            except queue.Empty:
                continue
            if directive is None:
                return
            yield self._with_roster(session.silo_id, directive)
            if directive.HasField("finished"):
                return

    def _with_roster(self, silo: str, directive: pb.JoinResponse) -> pb.JoinResponse:
        """A RoundSpec carries the roster to a silo that last named another (in a copy: directives are
        shared by the silos of a round)."""
        if not directive.HasField("round_spec"):
            return directive
        current = self.roster.current()
        if self._rosters_held.get(silo) == current.digest():
            return directive
        offered = pb.JoinResponse()
        offered.CopyFrom(directive)
        offered.roster = self.roster.raw()
        return offered

    @_abort_on_refusal
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        silo = self.identity.silo(context)
        remaining = request.privacy_remaining if request.HasField("privacy_remaining") else None
        self.inbox.heartbeat(
            silo, pb.SiloActivity.Name(request.activity).removeprefix("SILO_ACTIVITY_").lower(), remaining
        )
        self.store.touch_silo(silo, remaining)
        reply = pb.HeartbeatResponse(server_time_unix_ms=now_ms())
        # a running silo learns of a newer roster or CRL here, not only when it next registers
        if request.roster_sha256:
            self._rosters_held[silo] = request.roster_sha256
            if request.roster_sha256 != self.roster.current().digest():
                reply.roster = self.roster.raw()
        if request.crl_sha256:
            crl, digest = self.identity.revocations.current()
            if digest != request.crl_sha256:
                reply.crl = crl
        return reply

    @_abort_on_refusal
    def FetchState(self, request: pb.FetchStateRequest, context: grpc.ServicerContext) -> Iterator:
        data = self.inbox.state_for(self.identity.silo(context), request.round_id)
        return (pb.FetchStateResponse(offset=offset, data=part) for offset, part in chunks(data))

    @_abort_on_refusal
    def Submit(self, request_iterator: Iterator[pb.SubmitRequest], context: grpc.ServicerContext) -> Any:
        """An upload of the round's open sum: its header names the message it carries
        (`privacy.wire.upload_type`, with what the header adds: `submitted`), and the sum's layer half says
        whether it is due and how many bytes it has."""
        silo = self.identity.silo(context)
        header, parts = self._header(request_iterator, context, "Submit")
        try:
            kind = upload_type(header, layer=self._layer)
        except WireError as exc:
            raise Malformed(f"SubmitHeader: {exc}") from None
        purpose = _purpose(header.sum)
        limit = self.inbox.upload_bytes(silo, header.round_id, purpose, kind)
        if header.total_bytes > limit:
            raise BadContribution(f"header announces {header.total_bytes} bytes; the schema needs {limit}")
        payload = _payload(parts, header.total_bytes, header.sha256)
        digest = header.sha256
        upload = submitted(header, payload, layer=self._layer)
        self.inbox.upload(silo, header.round_id, purpose, upload, digest)
        return pb.SubmitResponse(round_id=header.round_id, sha256=digest, accepted_unix_ms=now_ms())

    def _key_service(self) -> KeyServiceRelay:
        if self.relay is None:
            layer = self.inbox.config.consortium.privacy
            raise NoKeyService(f"this consortium's privacy layer ({layer}) has no key service")
        return self.relay

    @_abort_on_refusal
    def ListEnrollments(self, request: pb.ListEnrollmentsRequest, context: grpc.ServicerContext) -> Any:
        self.identity.silo(context)
        enrollments = self._key_service().enrollments()
        return pb.ListEnrollmentsResponse(enrollments=map(enrollment_to_pb, enrollments))

    @_abort_on_refusal
    def ShareKey(self, request: pb.ShareKeyRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        relay = self._key_service()
        pem = context.auth_context()["x509_pem_cert"][0]
        sealed = [sealed_from_pb(s) for s in request.sealed]
        relay.share(silo, pem, request.context_id, request.public_key, sealed)
        log.info(
            "%s shared %s key %s, sealed to %d silos", silo, relay.layer, request.context_id[:16], len(sealed)
        )
        return pb.ShareKeyResponse(context_id=request.context_id)

    @_abort_on_refusal
    def FetchKey(self, request: pb.FetchKeyRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        sealed, holder_pem = self._key_service().fetch(silo, request.context_id)
        return pb.FetchKeyResponse(sealed=sealed_to_pb(sealed), holder_certificate=holder_pem)

    @_abort_on_refusal
    def FetchSum(self, request: pb.FetchSumRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        data = self.inbox.download(silo, request.round_id, _purpose(request.sum))
        return (pb.FetchSumResponse(offset=offset, data=part) for offset, part in chunks(data))

    @_abort_on_refusal
    def ReportState(
        self, request_iterator: Iterator[pb.ReportStateRequest], context: grpc.ServicerContext
    ) -> Any:
        """The next state a silo computed (where only silos read sums): a header, then the sealed state. The
        silo's signature over it is checked here, against the certificate TLS verified, and kept with it:
        the next round's silos check it too, and step from no state one of its counted silos did not sign."""
        silo = self.identity.silo(context)
        pem = context.auth_context()["x509_pem_cert"][0]
        header, parts = self._header(request_iterator, context, "ReportState")
        if header.evaluation_kind not in payload_kinds():
            raise Malformed("StateReportHeader.evaluation_kind carries no upload")
        if header.total_bytes > STATE_LIMIT:
            raise BadContribution(f"a state of {header.total_bytes} bytes; at most {STATE_LIMIT} are kept")
        sealed = _payload(parts, header.total_bytes, header.sha256)
        attestation = Attestation(header.state_signature, pem)
        counted = tuple(header.counted)
        try:
            check_report(
                self.members,
                silo,
                attestation,
                consortium=self.inbox.config.consortium.id,
                round_number=header.round,
                digest=header.state_digest,
                counted=counted,
                readers=self.inbox.readers(silo, header.round_id),
            )
        except NotAttested as exc:
            raise BadContribution(str(exc)) from None
        try:
            report = StateReport(
                digest=header.state_digest,
                sealed=sealed,
                schema=schema_from_pb(header.next_schema),
                remaining=header.remaining_rounds,
                trains=header.next_trains,
                evaluation=upload_of(header.evaluation_kind, header.evaluation, layer=self._layer),
                round=header.round,
                counted=counted,
                attestation=attestation,
            )
        except (ValueError, FedltError) as exc:
            raise Malformed(f"a state report that does not parse: {exc}") from None
        self.inbox.report_state(silo, header.round_id, report)
        return pb.ReportStateResponse(round_id=header.round_id)

    @_abort_on_refusal
    def ReportEvaluation(self, request: pb.ReportEvaluationRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        self.inbox.evaluation_reported(silo, request.round, list(request.correct), list(request.total))
        return pb.ReportEvaluationResponse(round=request.round)

    def _header(
        self, request_iterator: Iterator, context: grpc.ServicerContext, rpc: str
    ) -> tuple[Any, Iterator]:
        """A client stream's header, and the rest of the stream, bounded to `submit_seconds`."""
        parts = _within(request_iterator, self.submit_seconds, context)
        first = next(parts, None)
        if first is None or not first.HasField("header"):
            raise Malformed(f"a {rpc} stream starts with a header")
        return first.header, parts

    @_abort_on_refusal
    def Refuse(self, request: pb.RefuseRequest, context: grpc.ServicerContext) -> pb.RefuseResponse:
        """A silo will not take part in the attempt in flight, which invites it; the inbox takes it from
        then on as gone from the attempt, and shows and audits the reason."""
        silo = self.identity.silo(context)
        problems = _refusal_problems(request)
        if problems:
            raise Malformed("a refusal the aggregator cannot take: " + "; ".join(problems))
        self.inbox.refuse(silo, request.round_id, _code_name(request.code), request.text)
        return pb.RefuseResponse(round_id=request.round_id)

    @_abort_on_refusal
    def Disclose(self, request: pb.DiscloseRequest, context: grpc.ServicerContext) -> Any:
        silo = self.identity.silo(context)
        shape = tuple(request.shape)
        digest = self.inbox.disclose(silo, request.round_id, request.name, shape, request.values)
        return pb.DiscloseResponse(round_id=request.round_id, sha256=digest)


def _payload(parts: Iterator, expected: int, sha256: str) -> bytes:
    """The chunks after a stream's header: exactly `expected` bytes, with the SHA-256 the header names."""
    received, hasher = [], hashlib.sha256()
    for part in parts:
        if not part.HasField("chunk") or sum(map(len, received)) + len(part.chunk) > expected:
            raise Malformed("after the header come only chunks, adding up to total_bytes")
        if not part.chunk:
            raise Malformed("empty chunk: every chunk after the header carries payload bytes")
        received.append(part.chunk)
        hasher.update(part.chunk)
    payload = b"".join(received)
    if len(payload) != expected:
        raise BadContribution(f"received {len(payload)} of {expected} bytes")
    if hasher.hexdigest() != sha256:
        raise BadContribution("payload does not match the SHA-256 in its header")
    return payload


def _purpose(secure_sum: int) -> str:
    if secure_sum not in PURPOSE_OF_SUM:
        raise Malformed("a message about a round's sums names its sum (census or contribution)")
    return PURPOSE_OF_SUM[secure_sum]


def _stage_message(name: str, response: type) -> Callable:
    """A layer's stage RPC (`privacy.wire.receivers`): read the request in the caller's name, hand it over."""

    @_abort_on_refusal
    def handler(self: ConsortiumServicer, request: Any, context: grpc.ServicerContext) -> Any:
        cert = self.identity.certificate(context)
        silo = silo_id_of(cert)
        pem = context.auth_context()["x509_pem_cert"][0]  # the certificate TLS verified
        message = received(name, request, silo=silo, credential=pem, layer=self._layer)
        self.inbox.deliver(silo, request.round_id, _purpose(request.sum), message)
        return response(round_id=request.round_id)

    handler.__name__ = name
    return handler


for _rpc in receivers():
    if _rpc in ConsortiumServicer.__dict__:  # a layer never replaces one of the service's own RPCs
        raise RegistryError(f"a layer's stage RPC {_rpc} would replace the service's own")
    setattr(ConsortiumServicer, _rpc, _stage_message(_rpc, getattr(pb, f"{_rpc}Response")))


class OperatorServicer(operator_pb2_grpc.OperatorServiceServicer):
    """The operator's calls over the aggregator's studies. Each needs an operator certificate, whose name is
    the `by` of the change (written to the study's audit log). `warnings`: certificates that expire soon and
    roster problems, each with what resolves it."""

    def __init__(
        self, studies: StudyControl, identity: Identity, *, warnings: Callable[[], list[str]] = list
    ) -> None:
        self.studies = studies
        self.identity = identity
        self.warnings = warnings

    def _operator(self, context: grpc.ServicerContext) -> str:
        return operator_name_of(self.identity.certificate(context))

    @_abort_on_refusal
    def Status(self, request: operator_pb2.StatusRequest, context: grpc.ServicerContext) -> Any:
        self._operator(context)
        if request.study:
            _refuse_problems(id_problems(request.study, "study"))
        listed = self.studies.list()
        status = self.studies.status(request.study or _default_of(listed))
        return operator_pb2.StatusResponse(
            consortium_id=status["consortium_id"],
            method=status["method"],
            privacy=status["privacy"],
            committed_rounds=status["committed_rounds"],
            total_rounds=status["total_rounds"],
            round_id=status["round_id"],
            stage=status["stage"],
            stage_deadline_unix_ms=status["deadline_ms"],
            participants=status["participants"],
            submitted=status["submitted"],
            silos=[operator_pb2.SiloStatus(**silo) for silo in status["silos"]],
            state_digest=status["state_digest"],
            certificate_warnings=self.warnings(),
            study=status["study"],
            studies=[_study_pb(info) for info in listed],
            dp_enabled=status["dp_enabled"],
        )

    @_abort_on_refusal
    def CreateStudy(self, request: operator_pb2.CreateStudyRequest, context: grpc.ServicerContext) -> Any:
        by = self._operator(context)
        _refuse_problems(id_problems(request.id, "id") + _study_file_problems(request.study_toml))
        created = self.studies.create(request.id, request.study_toml, by=by)
        return operator_pb2.CreateStudyResponse(study=_study_pb(created))

    @_abort_on_refusal
    def ListStudies(self, request: operator_pb2.ListStudiesRequest, context: grpc.ServicerContext) -> Any:
        self._operator(context)
        return operator_pb2.ListStudiesResponse(studies=[_study_pb(info) for info in self.studies.list()])

    @_abort_on_refusal
    def PauseStudy(self, request: operator_pb2.PauseStudyRequest, context: grpc.ServicerContext) -> Any:
        by = self._operator(context)
        _refuse_problems(id_problems(request.id, "id"))
        return operator_pb2.PauseStudyResponse(study=_study_pb(self.studies.pause(request.id, by=by)))

    @_abort_on_refusal
    def ResumeStudy(self, request: operator_pb2.ResumeStudyRequest, context: grpc.ServicerContext) -> Any:
        by = self._operator(context)
        _refuse_problems(id_problems(request.id, "id"))
        return operator_pb2.ResumeStudyResponse(study=_study_pb(self.studies.resume(request.id, by=by)))

    @_abort_on_refusal
    def CancelStudy(self, request: operator_pb2.CancelStudyRequest, context: grpc.ServicerContext) -> Any:
        by = self._operator(context)
        _refuse_problems(id_problems(request.id, "id") + _reason_problems(request.reason))
        cancelled = self.studies.cancel(request.id, by=by, reason=request.reason)
        return operator_pb2.CancelStudyResponse(study=_study_pb(cancelled))


def _study_pb(info: StudyInfo) -> operator_pb2.Study:
    return operator_pb2.Study(
        id=info.id,
        state=info.state,
        reason=info.reason,
        is_default=info.is_default,
        queue_position=info.queue_position,
        method=info.method,
        privacy=info.privacy,
        committed_rounds=info.committed_rounds,
        total_rounds=info.total_rounds,
        state_digest=info.state_digest,
        created_unix_ms=info.created_ms,
        changed_unix_ms=info.changed_ms,
    )


def _default_of(studies: list[StudyInfo]) -> str:
    """The study consortium.toml defines (`[server] default_study`), which a status without an id shows."""
    for info in studies:
        if info.is_default:
            return info.id
    raise UnknownStudy("this aggregator has no default study")


def _refuse_problems(problems: list[str]) -> None:
    if problems:
        raise Malformed("a study request the aggregator cannot take: " + "; ".join(problems))


def _study_file_problems(text: str) -> list[str]:
    size = len(text.encode("utf-8"))
    if size > STUDY_FILE_BYTES:
        return [f"study_toml: {size:,} bytes; a study file is at most {STUDY_FILE_BYTES:,}"]
    return []


def _reason_problems(reason: str) -> list[str]:
    """A cancel's reason is kept in the audit log and shown beside the study: one short printable line."""
    if len(reason) > REFUSAL_TEXT_CHARS:
        return [f"reason: {len(reason)} characters; at most {REFUSAL_TEXT_CHARS}"]
    if not reason.isprintable():
        return ["reason: not one printable line"]
    return []
