"""The round driver without a network: submissions, refusals, status, and failures that must not kill it."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest
import torch

from aggregator.config import ConsortiumConfig, ConsortiumSection, TimeoutSection
from aggregator.round_table import AlreadySubmitted, NotParticipant, Stage, WrongRound
from aggregator.rounds import RoundDriver
from aggregator.store import Store
from fedlt.aggregation.halves import PartyKeys, SumAborted
from fedlt.aggregation.plaintext import PlaintextSum, Upload, to_wire
from fedlt.data.embedded import load_embedded, split_balanced_test
from fedlt.errors import ContributionError
from fedlt.methods.state import GlobalState, pack_state
from fedlt.metrics import ShotThresholds
from fedlt.recorder import RunRecorder
from privacy.secagg.protocol import MaskedInput
from tests.consortium_harness import AUDIT_KEY, PLAN


def plaintext_driver(tmp_path, config: ConsortiumConfig, roster: tuple[str, ...]) -> RoundDriver:
    """A plaintext driver over a new store in which silos a and b registered (as after their first start);
    what it echoes is kept in `driver.lines`."""
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    for silo in ("a", "b"):
        store.register_silo(silo, "c", "v", {})
    lines: list[str] = []
    driver = RoundDriver(
        config=config,
        store=store,
        method=PLAN.build_method(),
        layer=PlaintextSum(),
        side=PlaintextSum().aggregator_side(PartyKeys()),
        sign=lambda blob: b"signature",
        recorder=None,
        echo=lines.append,
        roster=lambda: roster,
    )
    driver.lines = lines
    return driver


@pytest.fixture
def driver(tmp_path):
    config = ConsortiumConfig(
        consortium=ConsortiumSection(rounds=2, min_silos=2, privacy="plaintext"), plan=PLAN
    )
    driver = plaintext_driver(tmp_path, config, ("a", "b"))
    yield driver
    driver.store.close()


def payload(driver: RoundDriver, n: float) -> tuple[bytes, str]:
    vector = torch.zeros(driver.table.held.schema.size, dtype=torch.float64)
    vector[-1] = n
    data = to_wire(driver.table.held.schema, vector)
    return data, hashlib.sha256(data).hexdigest()


def submit(driver: RoundDriver, silo: str, round_id: str, data: bytes, digest: str) -> str:
    """What the service does with a plaintext Submit stream whose size and SHA-256 it checked."""
    return driver.inbox.upload(silo, round_id, "contribution", Upload(data), digest)


def test_submissions_are_checked_against_the_attempt(driver):
    for silo in ("a", "b"):
        driver.inbox.connect(silo)
    attempt = driver._start_attempt(["a", "b"])
    data, digest = payload(driver, 3.0)
    assert submit(driver, "a", attempt.round_id, data, digest) == digest
    assert submit(driver, "a", attempt.round_id, data, digest) == digest  # an identical resend is idempotent
    other, other_digest = payload(driver, 4.0)
    with pytest.raises(SumAborted, match="already uploaded other values"):
        submit(driver, "a", attempt.round_id, other, other_digest)
    with pytest.raises(NotParticipant):
        submit(driver, "c", attempt.round_id, data, digest)
    with pytest.raises(WrongRound):
        submit(driver, "b", "r1.a9.other", data, digest)
    with pytest.raises(ContributionError, match="schema needs"):
        submit(driver, "b", attempt.round_id, data[:-8], digest)
    with pytest.raises(SumAborted, match="takes plaintext uploads"):
        driver.inbox.upload_bytes("b", attempt.round_id, "contribution", MaskedInput)
    status = driver.inbox.status()
    assert status["submitted"] == ["a"]
    assert status["participants"] == ["a", "b"]
    assert {s["silo_id"]: s["connected"] for s in status["silos"]} == {"a": True, "b": True}
    assert set(status["silos"][0]) == {
        "silo_id",
        "connected",
        "last_seen_unix_ms",
        "activity",
        "last_contributed_round",
    }


def test_a_participants_reconnect_gets_the_round_again(driver):
    session = driver.inbox.connect("a")
    driver.inbox.connect("b")
    attempt = driver._start_attempt(["a", "b"])
    first = session.directives.get_nowait()
    assert first.round_spec == attempt.signed
    again = driver.inbox.connect("a")
    assert again.directives.get_nowait().round_spec == attempt.signed


def test_unusable_sums_abort_the_attempt_instead_of_stopping_the_aggregator(driver):
    """Contributions that sum to zero samples cannot be averaged: the round is retried, not fatal."""
    stop = threading.Event()
    thread = threading.Thread(target=driver.run, args=(stop,))
    driver.inbox.connect("a")
    driver.inbox.connect("b")
    thread.start()
    try:
        for _ in range(2):
            deadline = threading.Event()
            while driver.table.attempt is None or driver.table.stage != Stage.COLLECTING:
                deadline.wait(0.05)
            attempt = driver.table.attempt
            for silo in ("a", "b"):
                data, digest = payload(driver, 0.0)
                submit(driver, silo, attempt.round_id, data, digest)
            while driver.table.attempt is attempt:
                deadline.wait(0.05)
        assert driver.store.attempt_statuses()[:2] == ["aborted", "aborted"]
        assert driver.failure is None
        assert driver.table.held.round == 0
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def test_a_round_committed_without_metrics_is_evaluated_at_start_up(tmp_path):
    """The aggregator died between committing round 1 and saving its metrics."""
    config = ConsortiumConfig(
        consortium=ConsortiumSection(rounds=2, min_silos=1, privacy="plaintext"), plan=PLAN
    )
    method = PLAN.build_method()
    store = Store(tmp_path / "db.sqlite", audit_key=AUDIT_KEY)
    store.bind(config.fingerprint())
    initial = method.init_state(seed=0)
    store.save_initial_state(initial.digest(), pack_state(initial))
    committed = GlobalState(1, initial.model)
    _, round_id = store.begin_attempt(1, ["a"], "n")
    store.commit_round(
        round_number=1,
        round_id=round_id,
        digest=committed.digest(),
        data=pack_state(committed),
        contributors=["a"],
    )
    _, test = split_balanced_test(load_embedded("digits"), per_class=30, seed=0)
    recorder = RunRecorder(
        tmp_path / "run", title="t", test=test, train_counts=None, thresholds=ShotThresholds(), header={}
    )
    lines: list[str] = []
    driver = RoundDriver(
        config=config,
        store=store,
        method=method,
        layer=PlaintextSum(),
        side=PlaintextSum().aggregator_side(PartyKeys()),
        sign=lambda b: b"",
        recorder=recorder,
        echo=lines.append,
    )
    driver.evaluator.shutdown()
    assert [m["round"] for m in store.metrics_history()] == [1]
    assert lines[0].startswith("round    1/2")
    store.close()


def test_disclosures_are_taken_only_from_silos_an_attempt_asks(driver):
    """A disclosure is refused outside its attempt, from a silo the attempt does not ask, when altered after
    it was accepted, and when the attempt asks for none; an identical resend is idempotent."""
    for silo in ("a", "b"):
        driver.inbox.connect(silo)
    shape = driver.picker.shape
    values = np.random.default_rng(0).random(shape).astype("<f8").tobytes()
    plain = driver._start_attempt(["a", "b"])
    with pytest.raises(NotParticipant, match="does not ask"):
        driver.inbox.disclose("a", plain.round_id, "mfsc", shape, values)
    driver.table.attempt = None
    attempt = driver._start_attempt(["a"], disclosers=["a", "b"])
    assert driver.inbox.state_for("b", attempt.round_id)  # a discloser fetches the state it computes means on
    digest = driver.inbox.disclose("b", attempt.round_id, "mfsc", shape, values)
    assert driver.inbox.disclose("b", attempt.round_id, "mfsc", shape, values) == digest
    altered = np.random.default_rng(1).random(shape).astype("<f8").tobytes()
    with pytest.raises(AlreadySubmitted):
        driver.inbox.disclose("b", attempt.round_id, "mfsc", shape, altered)
    with pytest.raises(WrongRound):
        driver.inbox.disclose("a", plain.round_id, "mfsc", shape, values)  # replayed into a finished attempt
    with pytest.raises(NotParticipant):
        driver.inbox.disclose("c", attempt.round_id, "mfsc", shape, values)
    with pytest.raises(NotParticipant):
        submit(driver, "b", attempt.round_id, *payload(driver, 1.0))  # disclosing is not training


def test_a_disclosure_counts_only_once_its_round_commits(driver):
    """An aborted attempt's disclosures are audited but not kept, so its retry picks as it did; the
    committed round's are kept in the book and in the store, with the round's picks, for a restart."""
    for silo in ("a", "b"):
        driver.inbox.connect(silo)
    shape = driver.picker.shape
    first = np.random.default_rng(0).random(shape).astype("<f8").tobytes()
    attempt = driver._start_attempt(["a", "b"], disclosers=["a", "b"])
    driver.inbox.disclose("b", attempt.round_id, "mfsc", shape, first)
    submit(driver, "a", attempt.round_id, *payload(driver, 1.0))
    driver._abort(attempt, "a deadline passed")
    assert driver.picker.book.disclosures == {}
    assert driver.store.disclosures("mfsc") == {}
    assert driver.table.let_down == {"b"}  # invited to train, gave nothing: a retry picks around it
    retry = driver._start_attempt(["a", "b"], disclosers=["a", "b"])
    driver.inbox.disclose("b", retry.round_id, "mfsc", shape, first)
    for silo in ("a", "b"):
        submit(driver, silo, retry.round_id, *payload(driver, 1.0))
    running = threading.Event()
    driver.committer.commit(retry, driver.committer.next_state(retry, driver._sums(retry, running), running))
    driver.evaluator.shutdown()
    kept = driver.picker.book.disclosures["b"].flatten()
    assert torch.equal(kept, torch.from_numpy(np.frombuffer(first).copy()))
    assert driver.store.disclosures("mfsc") == {"b": first}
    assert driver.store.last_picked() == {"a": 1, "b": 1} == driver.picker.book.last_picked
    assert driver.table.let_down == set()
    received = [r.detail["round_id"] for r in driver.store.audit_log() if r.event == "disclosure_received"]
    assert received == [attempt.round_id, retry.round_id]


def _gathering_driver(tmp_path, *, roster: tuple[str, ...], gather: float) -> RoundDriver:
    """Silos a and b registered, a roster naming `roster`, nothing committed."""
    config = ConsortiumConfig(
        consortium=ConsortiumSection(rounds=1, min_silos=2, privacy="plaintext"),
        plan=PLAN,
        timeouts=TimeoutSection(gather=gather),
    )
    return plaintext_driver(tmp_path, config, roster)


def _first_attempt(driver: RoundDriver, limit: float) -> tuple[float, list[str]]:
    """Run the driver with a and b connected until round 1's RoundSpec goes out (or `limit` passes): the
    seconds it took and whom it invited."""
    stop = threading.Event()
    for silo in ("a", "b"):
        driver.inbox.connect(silo)
    started = time.monotonic()
    thread = threading.Thread(target=driver.run, args=(stop,))
    thread.start()
    try:
        while driver.table.attempt is None and time.monotonic() - started < limit:
            stop.wait(0.05)
        attempt = driver.table.attempt
        return time.monotonic() - started, attempt.participants if attempt else []
    finally:
        stop.set()
        thread.join()
        driver.store.close()


def test_round_one_starts_once_every_roster_silo_is_connected(tmp_path):
    """The walkthrough's round 1 waited the whole `timeouts.gather` with every member connected."""
    driver = _gathering_driver(tmp_path, roster=("a", "b"), gather=600.0)
    seconds, invited = _first_attempt(driver, limit=120.0)
    assert invited == ["a", "b"]
    assert seconds < 120.0


def test_round_one_waits_the_gather_window_for_a_roster_silo_not_yet_connected(tmp_path):
    """Silo c, which the roster names, may still be starting: round 1 gives it the gather window."""
    driver = _gathering_driver(tmp_path, roster=("a", "b", "c"), gather=2.0)
    seconds, invited = _first_attempt(driver, limit=120.0)
    assert invited == ["a", "b"]
    assert seconds >= 2.0
