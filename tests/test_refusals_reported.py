"""Refusals reach the operator (issue 31, item 5).

A silo that will not take part in an attempt says so (`ConsortiumService.Refuse`) with a reason code and
words that name no fact of its data. The aggregator shows the refusal (the status RPC and its terminal view,
the status page and `status.json`), keeps it in the audit log, stops waiting for that silo, and ends the
attempt at once when the silos left cannot reach its floor, instead of waiting out the round's deadline (600 s
here, so a test that waited for it would fail on its own bounds). Before this, the silo only logged the
refusal: the operator saw it `idle`, and the attempt lasted exactly the round's timeout.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aggregator.config import (
    ConsortiumConfig,
    ConsortiumSection,
    TimeoutSection,
    load_consortium_config,
)
from aggregator.demo import point_silos_at
from aggregator.round_table import TAKEOVERS, NotParticipant, Sessions, Stage, WrongRound
from aggregator.rounds import RoundDriver
from aggregator.server import serve
from aggregator.service import (
    REFUSAL_TEXT_CHARS,
    _refusal_problems,
)
from aggregator.status import render
from aggregator.store import Store
from fedlt.aggregation.halves import PartyKeys
from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.config import read_toml, render_toml
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, operator_pb2, operator_pb2_grpc
from silo.admission import one_line
from silo.agent import SiloAgent
from silo.config import load_silo_config
from tests.consortium_harness import AUDIT_KEY, PLAN, Consortium, code_of, servicer_channel
from tests.test_rounds import payload, submit

DEADLINE = 600.0  # the round's timeout: nothing here may wait for it
BOUND = 60.0  # how long a test waits for what must happen at once, on a busy machine
SILOS = ("a", "b", "c")
WORDS = "method 'fedavg' is not allowed by policy.methods"

_T = TypeVar("_T")


def make_driver(tmp_path: Path, *, min_silos: int) -> RoundDriver:
    config = ConsortiumConfig(
        consortium=ConsortiumSection(rounds=1, min_silos=min_silos, privacy="plaintext"),
        timeouts=TimeoutSection(gather=0.0, round=DEADLINE),
        plan=PLAN,
    )
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    for silo in SILOS:
        store.register_silo(silo, "c", "v", {})
    return RoundDriver(
        config=config,
        store=store,
        method=config.plan.build_method(),
        layer=PlaintextSum(),
        side=PlaintextSum().aggregator_side(PartyKeys()),
        sign=lambda blob: b"signature",
        recorder=None,
        echo=lambda line: None,
    )


@contextmanager
def driving(driver: RoundDriver) -> Iterator[None]:
    """The round driver on a thread, stopped (and its store closed) when the test ends."""
    stop = threading.Event()
    thread = threading.Thread(target=driver.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
        driver.store.close()
    assert not thread.is_alive()
    assert driver.failure is None


def until(driver: RoundDriver, value: Callable[[], _T], what: str, seconds: float = BOUND) -> _T:
    """`value()` once it is truthy, waiting on the round table's condition (woken by every message the
    inbox takes)."""
    limit = time.monotonic() + seconds
    with driver.table.lock:
        while not (found := value()):
            if time.monotonic() > limit:
                raise AssertionError(f"no {what} within {seconds:g} s")
            driver.table.lock.wait(0.1)
    return found


def attempt_row(store: Store, round_id: str) -> tuple[str, int, int, str]:
    return store._db.execute(
        "SELECT status, started_ms, ended_ms, reason FROM attempts WHERE round_id = ?", (round_id,)
    ).fetchone()


def refusals(store: Store) -> list[dict]:
    return [r.detail for r in store.audit_log() if r.event == "round_refused"]


# --- the round driver ---------------------------------------------------------------------------------


def test_a_refusal_that_leaves_the_attempt_short_of_its_floor_ends_it_at_once(tmp_path):
    """min_silos 3 of 3: with one refusing, the attempt cannot complete. It ends at once (not at the 600 s
    deadline), the silo is left out while its refusal stands, and a reconnect (with another policy,
    perhaps) brings it back."""
    driver = make_driver(tmp_path, min_silos=3)
    sessions = {silo: driver.inbox.connect(silo) for silo in SILOS}
    with driving(driver):
        attempt = until(driver, lambda: driver.table.attempt, "attempt")
        driver.inbox.refuse("a", attempt.round_id, "policy", WORDS)
        until(
            driver,
            lambda: driver.table.attempt is None and driver.table.stage == Stage.GATHERING,
            "end of the attempt",
        )
        status, started, ended, reason = attempt_row(driver.store, attempt.round_id)
        assert status == "aborted"
        assert ended - started < 1000 * BOUND < 1000 * DEADLINE
        assert (
            reason
            == "the round failed: refused by a (policy): 2 of 3 participants left, fewer than min_silos 3"
        )
        abort = [d for d in _drained(sessions["b"]) if d.HasField("abort")]
        assert abort[0].abort.reason == reason  # the other silos learn the code, not the refuser's words
        assert refusals(driver.store) == [
            {"round_id": attempt.round_id, "silo": "a", "code": "policy", "text": WORDS}
        ]
        shown = {s["silo_id"]: s.get("refusal") for s in driver.inbox.status()["silos"]}
        assert shown["a"] is not None
        assert (shown["a"]["round_id"], shown["a"]["code"], shown["a"]["text"]) == (
            attempt.round_id,
            "policy",
            WORDS,
        )
        assert (shown["b"], shown["c"]) == (None, None)
        with driver.table.lock:
            assert driver.table.ready() == ["b", "c"]  # asked again, "a" would refuse again: the round waits
        driver.inbox.connect("a")  # its administrator changed the policy and restarted the agent
        retry = until(driver, lambda: driver.table.attempt, "second attempt")
        assert retry.round_id != attempt.round_id
        assert retry.participants == list(SILOS)
        assert "refusal" not in next(s for s in driver.inbox.status()["silos"] if s["silo_id"] == "a")


def test_a_refusal_that_leaves_enough_silos_lets_the_rest_commit_without_waiting(tmp_path):
    """min_silos 2 of 3: the attempt goes on without the silo that said no, and no stage waits for it."""
    driver = make_driver(tmp_path, min_silos=2)
    for silo in SILOS:
        driver.inbox.connect(silo)
    with driving(driver):
        attempt = until(driver, lambda: driver.table.attempt, "attempt")
        driver.inbox.refuse("c", attempt.round_id, "budget", "the round would spend more budget than is left")
        for silo in ("a", "b"):
            submit(driver, silo, attempt.round_id, *payload(driver, 1.0))
        until(driver, lambda: driver.table.stage == Stage.FINISHED, "commit")
        status, started, ended, _ = attempt_row(driver.store, attempt.round_id)
        assert status == "committed"
        assert ended - started < 1000 * BOUND
        committed = driver.store._db.execute("SELECT contributors FROM states WHERE round = 1").fetchone()
        assert json.loads(committed[0]) == ["a", "b"]
        # a new state: no refusal of it stands
        assert "refusal" not in json.dumps(driver.inbox.status()["silos"])


def test_only_an_invited_silo_refuses_only_the_attempt_in_flight_and_its_first_words_stand(tmp_path):
    driver = make_driver(tmp_path, min_silos=2)
    for silo in SILOS:
        driver.inbox.connect(silo)
    attempt = driver._start_attempt(["a", "b"])
    with pytest.raises(WrongRound):
        driver.inbox.refuse("a", "r1.a9.deadbeef", "policy", WORDS)  # an attempt not in flight
    with pytest.raises(NotParticipant):
        driver.inbox.refuse("c", attempt.round_id, "policy", WORDS)
    driver.inbox.refuse("a", attempt.round_id, "policy", WORDS)
    driver.inbox.refuse("a", attempt.round_id, "other", "said again, otherwise")
    assert refusals(driver.store) == [
        {"round_id": attempt.round_id, "silo": "a", "code": "policy", "text": WORDS}
    ]
    assert (
        driver.table.short_of_floor(attempt)
        == "refused by a (policy): 1 of 2 participants left, fewer than min_silos 2"
    )
    driver.store.close()


def test_a_second_refusal_arriving_after_the_first_ended_the_attempt_is_kept_and_shown(tmp_path):
    """Two silos refusing at once (found walking through docs/bring-your-own.md): the first ended the attempt,
    and the second's refusal was turned away as for no attempt in flight, so the operator never saw why it
    would not take part, and the next attempt invited it again."""
    driver = make_driver(tmp_path, min_silos=3)
    for silo in SILOS:
        driver.inbox.connect(silo)
    with driving(driver):
        attempt = until(driver, lambda: driver.table.attempt, "attempt")
        driver.inbox.refuse("a", attempt.round_id, "policy", WORDS)
        until(driver, lambda: driver.table.attempt is None, "end of the attempt")
        driver.inbox.refuse("b", attempt.round_id, "data", "this silo's data does not fit the plan")
        assert [r["silo"] for r in refusals(driver.store)] == ["a", "b"]
        shown = {s["silo_id"]: s.get("refusal") for s in driver.inbox.status()["silos"]}
        assert shown["b"]["code"] == "data"
        with driver.table.lock:
            assert driver.table.ready() == ["c"]
        with pytest.raises(NotParticipant):  # only a silo that attempt invited
            driver.inbox.refuse("z", attempt.round_id, "policy", WORDS)
        with pytest.raises(WrongRound):  # and only the attempt that just ended, no older one
            driver.inbox.refuse("c", "r1.a0.deadbeef", "policy", WORDS)


def test_a_refusal_stands_for_its_state_its_session_and_the_rounds_timeout_only(tmp_path):
    """A refusal for a passing reason (a CKKS key not fetched yet) must not keep a silo out forever."""
    driver = make_driver(tmp_path, min_silos=2)
    for silo in SILOS:
        driver.inbox.connect(silo)
    attempt = driver._start_attempt(list(SILOS))
    driver.inbox.refuse("a", attempt.round_id, "policy", WORDS)
    refusal = driver.table.refusals["a"]
    with driver.table.lock:
        assert driver.table.ready() == ["b", "c"]
        driver.table.refusals["a"] = replace(refusal, at_ms=refusal.at_ms - int(1000 * DEADLINE) - 1)
        assert driver.table.ready() == list(SILOS)
        driver.table.refusals["a"] = replace(refusal, state_digest="another state")
        assert driver.table.ready() == list(SILOS)
    driver.store.close()


def _drained(session) -> list[pb.JoinResponse]:
    directives = []
    while not session.directives.empty():
        directives.append(session.directives.get_nowait())
    return directives


# --- the wire: what the aggregator takes as a refusal -------------------------------------------------


@pytest.fixture
def refuse_as_silo(tmp_path) -> Iterator[tuple[Callable, RoundDriver, str]]:
    """The real servicer behind the certificate gate, over mutual TLS on 127.0.0.1, before the inbox of a
    real round driver whose attempt in flight invites silo-0 and silo-1; (call Refuse as silo-0, the
    driver, the round id)."""
    driver = make_driver(tmp_path, min_silos=2)
    for silo in ("silo-0", "silo-1"):
        driver.inbox.connect(silo)
    attempt = driver._start_attempt(["silo-0", "silo-1"])
    try:
        with servicer_channel(
            tmp_path, driver.inbox, driver.store, gated=True, submit_seconds=60.0
        ) as channel:
            stub = consortium_pb2_grpc.ConsortiumServiceStub(channel)
            raw = channel.unary_unary("/fedlt.v1.ConsortiumService/Refuse")

            def refuse(request: pb.RefuseRequest | bytes) -> object:
                if isinstance(request, bytes):
                    return raw(request, timeout=30)
                return stub.Refuse(request, timeout=30)

            yield refuse, driver, attempt.round_id
    finally:
        driver.store.close()


def test_malformed_refusals_are_rejected_and_change_nothing(refuse_as_silo):
    refuse, driver, round_id = refuse_as_silo
    good = {"round_id": round_id, "code": pb.REFUSAL_CODE_POLICY, "text": WORDS}
    malformed = {
        "no round id": {**good, "round_id": ""},
        "an endless round id": {**good, "round_id": "r" * 65},
        "no code": {**good, "code": pb.REFUSAL_CODE_UNSPECIFIED},
        "a code no schema defines": {**good, "code": 99},
        "no words": {**good, "text": "  "},
        "too many words": {**good, "text": "x" * (REFUSAL_TEXT_CHARS + 1)},
        "a second line": {**good, "text": "refused\nERROR forged log line"},
        "a terminal escape": {**good, "text": "refused \x1b[2J"},
    }
    for name, fields in malformed.items():
        code, details = code_of(lambda fields=fields: refuse(pb.RefuseRequest(**fields)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name
    code, details = code_of(lambda: refuse(b"\x0a\xff\xff\xff"))  # no RefuseRequest at all
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details = code_of(lambda: refuse(pb.RefuseRequest(**{**good, "round_id": "r1.a7.00000000"})))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no attempt 'r1.a7.00000000' in flight" in details
    assert refusals(driver.store) == []
    assert driver.table.attempt is not None
    assert not driver.table.attempt.refused
    assert refuse(pb.RefuseRequest(**good)).round_id == round_id
    assert refusals(driver.store) == [
        {"round_id": round_id, "silo": "silo-0", "code": "policy", "text": WORDS}
    ]


@given(st.text(max_size=2 * REFUSAL_TEXT_CHARS))
def test_whatever_a_silo_has_to_say_it_words_so_the_aggregator_takes_it(text):
    """The silo's side (`one_line`) and the aggregator's (`_refusal_problems`) agree on every input: a
    refusal is never lost to a newline or a long message."""
    request = pb.RefuseRequest(round_id="r1.a1.x", code=pb.REFUSAL_CODE_OTHER, text=one_line(text))
    assert _refusal_problems(request) == []


# --- end to end: a silo agent whose policy refuses the plan's method ----------------------------------


@pytest.fixture
def consortium(tmp_path) -> Iterator[tuple[Consortium, Callable[[], dict]]]:
    """The aggregator (`serve`) and three silo agents on threads of this process, over mutual TLS on
    127.0.0.1, with a 600 s round deadline; silo-0's administrator lists only creff in its policy. Yields the
    consortium and a reader of the status page's `/status.json`; everything is stopped at the end."""
    made = Consortium.create(tmp_path, rounds=1, min_silos=3, round_timeout=DEADLINE)
    tree = read_toml(made.silo_configs[0])
    tree["policy"]["methods"] = ["creff"]
    made.silo_configs[0].write_text(render_toml(tree))
    stop = threading.Event()
    threads = torch.get_num_threads()
    aggregator = threading.Thread(
        target=serve,
        args=(load_consortium_config(tmp_path / "consortium.toml"),),
        kwargs={"stop": stop, "echo": made.output.append},
        daemon=True,
    )
    aggregator.start()
    silos: list[threading.Thread] = []
    try:
        made.address = _listening(made, stop)["address"]
        point_silos_at(made.address, made.silo_configs)
        for path in made.silo_configs:
            agent = SiloAgent(load_silo_config(path), stop=stop)
            silos.append(threading.Thread(target=agent.run, daemon=True))
            silos[-1].start()
        yield made, lambda: _status_json(_listening(made, stop))
    finally:
        stop.set()
        for thread in [*silos, aggregator]:
            thread.join(60)
        torch.set_num_threads(threads)  # the agents set it for this process
    assert not any(thread.is_alive() for thread in [*silos, aggregator])


def _listening(made: Consortium, stop: threading.Event) -> dict:
    path = made.data_dir / "listening.json"
    limit = time.monotonic() + BOUND
    while not path.exists():
        if time.monotonic() > limit:
            raise AssertionError("the aggregator did not listen:\n" + "\n".join(made.output))
        stop.wait(0.05)
    return json.loads(path.read_text())


def _status_json(listening: dict) -> dict:
    host, port = listening["status_page"].removeprefix("http://").rstrip("/").rsplit(":", 1)
    token = Path(listening["status_page_token"]).read_text().strip()
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", "/status.json", headers={"Authorization": f"Bearer {token}"})
    return json.loads(connection.getresponse().read())


def _operator_status(made: Consortium) -> operator_pb2.StatusResponse:
    pki = made.directory / "pki"
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca" / "ca.pem").read_bytes(),
        private_key=(pki / "operator.key").read_bytes(),
        certificate_chain=(pki / "operator.pem").read_bytes(),
    )
    with grpc.secure_channel(made.address, credentials) as channel:
        return operator_pb2_grpc.OperatorServiceStub(channel).Status(operator_pb2.StatusRequest(), timeout=30)


def test_a_silo_refusing_the_plans_method_is_seen_by_the_operator_and_the_attempt_ends_at_once(consortium):
    made, status_json = consortium
    limit = time.monotonic() + 2 * BOUND
    while not (aborted := _aborted(made)):
        assert time.monotonic() < limit, "the refused attempt did not end:\n" + "\n".join(made.output)
        threading.Event().wait(0.1)
    round_id, started, ended, reason = aborted
    assert ended - started < 1000 * BOUND < 1000 * DEADLINE
    assert "refused by silo-0 (policy)" in reason
    store = made.store()
    try:
        (refused,) = refusals(store)
        store.verify_audit()
    finally:
        store.close()
    assert refused == {"round_id": round_id, "silo": "silo-0", "code": "policy", "text": refused["text"]}
    assert "method 'fedavg' is not allowed by policy.methods" in refused["text"]
    assert str(made.directory) not in refused["text"]  # nothing of where the silo keeps its data
    row = next(s for s in status_json()["silos"] if s["silo_id"] == "silo-0")
    assert (row["refusal"]["round_id"], row["refusal"]["code"]) == (round_id, "policy")
    assert row["refusal"]["text"] == refused["text"]
    shown = _operator_status(made)
    silo = next(s for s in shown.silos if s.silo_id == "silo-0")
    assert silo.HasField("refusal")
    assert silo.refusal.text == refused["text"]
    assert not next(s for s in shown.silos if s.silo_id == "silo-1").HasField("refusal")
    terminal = render(shown)
    assert f"  └ refused {round_id}: policy: {refused['text']}" in terminal
    assert any(line.startswith("silo-0") and " refused " in line for line in terminal.splitlines())
    assert shown.stage == "gathering"  # silo-1 and silo-2 alone are fewer than min_silos: the round waits


def _aborted(made: Consortium) -> tuple[str, int, int, str] | None:
    store = made.store()
    try:
        return store._db.execute(
            "SELECT round_id, started_ms, ended_ms, reason FROM attempts WHERE status = 'aborted'"
        ).fetchone()
    finally:
        store.close()


def test_a_silo_that_keeps_taking_over_its_own_session_is_named(caplog):
    """Found walking through the operator guide: two agents of one silo, each with its own state directory,
    took the silo's place from each other every few seconds and no round completed, without a word."""
    lock = threading.Condition()
    sessions = Sessions(lock)
    with caplog.at_level(logging.WARNING, logger="aggregator"), lock:
        sessions.open("st-marys")
        sessions.open("st-marys")  # a reconnect now and then says nothing
        assert "two agents" not in caplog.text
        for _ in range(TAKEOVERS):
            sessions.open("st-marys")
    assert caplog.text.count("are two agents running with its certificate") == 1
