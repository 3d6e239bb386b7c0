"""A blind consortium of real processes: secagg's sums under the silos' output masks, stepped by the silos.

What it must show: the aggregator and silo agents run the `blind` layer with no layer-specific code, and the
model the silos end with is secagg's to the bit on the same seed (the same fixed-point sums, the same server
step), with the same accuracy for the operator (the silos' summed evaluation counts); every silo computed the
same state and the aggregator committed exactly that one, sealed, never in the clear. A silo lost in the
middle of a sum is recovered as secagg recovers it.

What is compared: under secagg the aggregator steps the model and stores it in the clear, under blind the
silos step it and the aggregator stores it sealed under the output key; both store the digest of the
plaintext state (`GlobalState.digest`), so the digests are compared round by round, the sealed states are
opened with a silo's key and compared tensor by tensor (atol = 0), and the metrics the store records
(accuracy, its many/medium/few split, per-class accuracy, contributors) are compared as numbers.
"""

from __future__ import annotations

import re

import pytest

from aggregator.held_state import HeldState
from fedlt.methods.state import GlobalState, unpack_state
from fedlt.tensorpack import PackError
from privacy.blind.keys import OutputKey
from privacy.stepping.sealed_state import open_state
from tests.consortium_harness import PLAN, Consortium
from tests.test_consortium import (  # noqa: F401 (make_consortium is a fixture)
    assert_same_model,
    contributors,
    make_consortium,
    simulated_run,
)

ROUNDS = 2
STEPPED = re.compile(r"round (\d+): stepped the model to state ([0-9a-f]{64})")
SCORES = ("accuracy", "many", "medium", "few", "per_class")  # what the operator sees of a round's model


def _output_key(consortium: Consortium, k: int) -> OutputKey:
    (path,) = (consortium.directory / f"silo-{k}-state" / "blind").glob("*.secret")
    return OutputKey.from_secret_bytes(path.read_bytes())


def _run(consortium: Consortium, timeout: float = 300) -> None:
    consortium.start()
    assert consortium.wait_aggregator(timeout=timeout) == 0, "\n".join(consortium.output[-30:])
    consortium.stop()


def _committed(consortium: Consortium) -> tuple[list[tuple[int, str, bytes]], list[dict]]:
    """Every committed state (round, digest, stored bytes) and the metrics the store recorded."""
    store = consortium.store()
    try:
        states = store._db.execute("SELECT round, digest, data FROM states ORDER BY round").fetchall()
        return states, store.metrics_history()
    finally:
        store.close()


def _opened(consortium: Consortium, round_number: int, digest: str, data: bytes) -> GlobalState:
    """A state as the aggregator keeps it under blind, which only a silo's copy of the output key opens."""
    with pytest.raises(PackError):
        unpack_state(data, round_number)  # not in the clear
    sealed = HeldState.from_stored(data, round_number, digest, PLAN.build_method()).blob
    packed = open_state(
        _output_key(consortium, 1),
        consortium="test-consortium",
        round_number=round_number,
        digest=digest,
        sealed=sealed,
    )
    opened = unpack_state(packed, round_number)
    assert opened.digest() == digest
    return opened


def _stepped_alike(consortium: Consortium, silos: int, states: list[tuple[int, str, bytes]]) -> None:
    """Every silo logged the state it stepped to each round, all the same, and the committed one."""
    logs = [(consortium.directory / f"silo-{k}.log").read_text() for k in range(silos)]
    stepped = [dict(STEPPED.findall(log)) for log in logs]
    committed = {str(r): d for r, d, _ in states if r > 0}
    assert all(s == committed for s in stepped), stepped


def test_a_blind_consortium_steps_the_secagg_simulators_states_and_scores_to_the_bit(
    make_consortium,  # noqa: F811
    tmp_path,
):
    """The fast one: the secagg simulator is the secagg consortium to the bit
    (tests/test_consortium.py::test_full_run_gives_the_simulators_model); here the blind consortium is too."""
    consortium = make_consortium(rounds=ROUNDS, min_silos=3, privacy="blind")
    _run(consortium)
    states, metrics = _committed(consortium)
    secagg = simulated_run(tmp_path, rounds=ROUNDS, privacy="secagg")

    assert [r for r, _, _ in states] == list(range(ROUNDS + 1))
    assert [d for r, d, _ in states if r > 0] == [m["state_digest"] for m in secagg.metrics["rounds"]]
    _stepped_alike(consortium, 3, states)
    final_round, final_digest, final_data = states[-1]
    assert_same_model(_opened(consortium, final_round, final_digest, final_data), secagg.state, atol=0)
    assert [{k: m[k] for k in ("round", *SCORES)} for m in metrics] == [
        {k: m[k] for k in ("round", *SCORES)} for m in secagg.metrics["rounds"]
    ]


@pytest.mark.slow  # two consortia one after the other (about 60 s); the simulator stands in above
def test_a_blind_consortium_commits_a_secagg_consortiums_states_and_metrics_to_the_bit(
    make_consortium,  # noqa: F811
):
    blind = make_consortium(rounds=ROUNDS, min_silos=3, privacy="blind")
    _run(blind)
    secagg = make_consortium(rounds=ROUNDS, min_silos=3, privacy="secagg")
    _run(secagg)

    blind_states, blind_metrics = _committed(blind)
    secagg_states, secagg_metrics = _committed(secagg)
    assert [(r, d) for r, d, _ in blind_states] == [(r, d) for r, d, _ in secagg_states]
    assert blind_states[0][2] == secagg_states[0][2]  # the seeded initial state, public under both
    _stepped_alike(blind, 3, blind_states)
    for (round_number, digest, data), (_, _, plain) in zip(blind_states[1:], secagg_states[1:], strict=True):
        opened = _opened(blind, round_number, digest, data)
        assert_same_model(opened, unpack_state(plain, round_number), atol=0)
    keys = ("round", *SCORES, "contributors")
    assert [{k: m[k] for k in keys} for m in blind_metrics] == [
        {k: m[k] for k in keys} for m in secagg_metrics
    ]


@pytest.mark.parametrize(
    ("drill", "counted"),
    [
        # left after its key shares, before its masked input: left out of the sum, as under secagg
        ("shares", ["silo-0", "silo-1", "silo-2"]),
        # left after its masked input: secagg rebuilds its self mask from the peers' shares and counts it
        # (counted, as its input is in the sum, though it reads nothing: the three that read the sum step,
        # sign who read it, and the round commits over their reports)
        ("masked", ["silo-0", "silo-1", "silo-2", "silo-3"]),
    ],
)
@pytest.mark.slow  # about 35 s each; the same recovery in process: tests/test_blind.py
def test_a_blind_round_recovers_a_silo_killed_mid_sum_as_secagg_does(
    make_consortium,  # noqa: F811
    drill,
    counted,
):
    """Threshold 3 of 4: one silo may leave. It freezes where the drill says, in round 1's contribution sum,
    and is killed there; the others read the sum without it (or with its input, its masks rebuilt), step,
    and go on to round 2 without it."""
    consortium = make_consortium(rounds=ROUNDS, min_silos=3, silos=4, privacy="blind")
    consortium.start(drills={3: drill})
    consortium.wait_for_silo_log(3, "drill: stopping", timeout=180)
    consortium.kill(consortium.silos[3])
    ended = consortium.wait_for_output(
        lambda line: line == "all rounds committed" or "waits for silo-3" in line, timeout=400
    )
    assert ended == "all rounds committed", "\n".join(consortium.output[-30:])
    assert consortium.wait_aggregator(timeout=60) == 0
    rounds = contributors(consortium)
    assert rounds == {1: counted, 2: ["silo-0", "silo-1", "silo-2"]}
    states, metrics = _committed(consortium)
    _stepped_alike(consortium, 3, states)
    assert {m["round"]: m["contributors"] for m in metrics} == rounds
