"""A real consortium: aggregator and silo agents as processes talking gRPC over mutual TLS on 127.0.0.1."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest
import torch

from fedlt.methods import METHODS, MethodChoice
from fedlt.selection import SelectionConfig, simulated_mask_secret
from fedlt.sim.config import ModelChoice, SimConfig
from fedlt.sim.run import run_simulation
from tests.consortium_harness import PLAN, RECIPE, SILO_THREADS, Consortium


@pytest.fixture
def make_consortium(tmp_path):
    made: list[Consortium] = []

    def make(**options) -> Consortium:
        consortium = Consortium.create(tmp_path / f"c{len(made)}", **options)
        made.append(consortium)
        return consortium

    yield make
    for consortium in made:
        consortium.stop()


def simulated_run(
    tmp_path,
    rounds: int,
    silos: int = 3,
    privacy: str = "secagg",
    method=PLAN.method,
    selection=PLAN.selection,
):
    config = SimConfig(
        seed=0,
        privacy=privacy,
        rounds=rounds,
        data=RECIPE.__class__(**{**RECIPE.__dict__, "silos": silos}),
        model=ModelChoice(PLAN.model.name),
        train=PLAN.train,
        method=method,
        selection=selection,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(SILO_THREADS)
    try:
        return run_simulation(config, tmp_path / f"sim-{privacy}", echo=lambda _: None)
    finally:
        torch.set_num_threads(threads)


def simulated_state(tmp_path, rounds: int, **options):
    return simulated_run(tmp_path, rounds, **options).state


def assert_same_model(a, b, atol: float = 1e-5):
    assert a.round == b.round
    assert set(a.model) == set(b.model)
    for name in a.model:
        assert torch.allclose(a.model[name].double(), b.model[name].double(), atol=atol), name


def contributors(consortium: Consortium) -> dict[int, list[str]]:
    """The silos each committed round's sum counted (from round 1)."""
    return {r: silos for r, silos in consortium.committed().items() if r > 0}


QUICK_OPTIONS = {"sfd": {"rff_features": 200, "synthesis_steps": 5, "finetune_epochs": 5}}


# statistics (ccvr) in the default run; per-class gradients (creff, redgrape) and the rest of the same paths
# in `make test-all` (RedGrape's through every fault-injection test), to keep the default run under ten
# minutes; tests/test_methods_smoke.py sends per-class fields through the secure layer in every run
HEAVY = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    [
        "ccvr",
        pytest.param("creff", marks=HEAVY),
        pytest.param("redgrape", marks=HEAVY),
        pytest.param("sfd", marks=HEAVY),
        pytest.param("dflfs", marks=HEAVY),
        pytest.param("balanced", marks=HEAVY),
    ],
)
def test_long_tail_methods_give_the_simulators_state_through_census_and_secure_sums(
    make_consortium, tmp_path, name
):
    """Per-class fields go through the census and the tail guard in real processes; the post-hoc methods'
    closing round runs after training; the state equals the secagg simulator's bit for bit."""
    plan = replace(PLAN, method=MethodChoice(name, METHODS[name].Options(**QUICK_OPTIONS.get(name, {}))))
    consortium = make_consortium(rounds=2, min_silos=3, plan=plan)
    consortium.start()
    assert consortium.wait_aggregator(timeout=240) == 0
    final = consortium.final_state()
    expected = simulated_state(tmp_path, rounds=2, method=plan.method)
    # the post-hoc methods close with a statistics round, the balanced recipe opens with a priors round
    extra_round = name in ("ccvr", "sfd", "dflfs", "balanced")
    assert final.round == (3 if extra_round else 2)
    assert_same_model(final, expected, atol=0)
    assert set(final.extra) == set(expected.extra)
    for key in expected.extra:
        assert torch.equal(final.extra[key], expected.extra[key]), key
    store = consortium.store()
    log = store.audit_log()
    store.close()
    committed = {r.detail["round_id"] for r in log if r.event == "round_committed"}
    guarded = {r.detail["round_id"] for r in log if r.event == "tail_guard"} & committed
    # a census runs in every round with per-class fields (the post-hoc methods: the closing round only, the
    # balanced recipe: its priors round only);
    # a retried attempt (a deadline missed on a loaded machine) has a census too, so count committed rounds
    retried = [r.detail for r in log if r.event in ("attempt_aborted", "attempt_abandoned")]
    assert len(guarded) == (1 if extra_round else 2), retried


@HEAVY
def test_mfsc_picks_the_simulators_silos_from_disclosures_of_every_connected_silo(make_consortium, tmp_path):
    """Three of four silos train per round, picked tail-class first from the masked class means that all four
    disclose; the disclosures are audited, never the values; the run equals the simulator's bit for bit."""
    selection = SelectionConfig(per_round=3, strategy="mfsc")
    plan = replace(PLAN, method=MethodChoice("dflfs", METHODS["dflfs"].Options()), selection=selection)
    consortium = make_consortium(rounds=3, min_silos=3, silos=4, plan=plan)
    for k in range(4):  # the silos' own mask secrets, set to the simulator's so that the runs can be compared
        state_dir = consortium.directory / f"silo-{k}-state"
        state_dir.mkdir()
        (state_dir / "mask.secret").write_bytes(simulated_mask_secret(0, f"silo-{k}"))
    consortium.start()
    assert consortium.wait_aggregator(timeout=240) == 0
    sim = simulated_run(tmp_path, rounds=3, silos=4, method=plan.method, selection=selection)
    final = consortium.final_state()
    assert_same_model(final, sim.state, atol=0)
    for key in sim.state.extra:
        assert torch.equal(final.extra[key], sim.state.extra[key]), key
    picked = {r["round"]: r["participants"] for r in sim.metrics["rounds"] if r["round"] <= 3}
    assert all(len(p) == 3 for p in picked.values())
    assert contributors(consortium) == {**picked, 4: [f"silo-{k}" for k in range(4)]}  # closing: everyone
    store = consortium.store()
    log = store.audit_log()
    store.close()
    disclosed = [r.detail for r in log if r.event == "disclosure_received"]
    assert len(disclosed) == 3 * 4  # every connected silo, every training round, none in the closing round
    assert all(set(d) == {"round_id", "silo", "name", "sha256"} for d in disclosed)
    assert "disclosed masked class means" in (consortium.directory / "silo-3.log").read_text()


def test_full_run_gives_the_simulators_model(make_consortium, tmp_path):
    consortium = make_consortium(rounds=2, min_silos=3)
    consortium.start()
    assert consortium.wait_aggregator(timeout=180) == 0
    assert any("all rounds committed" in line for line in consortium.output)
    final = consortium.final_state()
    assert_same_model(final, simulated_state(tmp_path, rounds=2), atol=0)  # the same secure sums
    # (against plaintext sums, one step is within the codec's stated bound: tests/test_fedavg.py)
    for silo in consortium.silos.values():
        assert silo.wait(30) == 0, "silo agents exit cleanly once the consortium is finished"
    store = consortium.store()
    store.verify_audit()
    events = [r.event for r in store.audit_log()]
    store.close()
    assert events.count("silo_enrolled") == 3
    assert events.count("round_committed") == 2
    assert (consortium.data_dir / "run" / "metrics.json").exists()


@HEAVY  # a killed silo is also the default run's test_secure_round_recovers_a_silo_killed_mid_protocol
def test_round_completes_without_a_killed_silo_when_enough_remain(make_consortium):
    consortium = make_consortium(rounds=2, min_silos=3, silos=4)
    consortium.start()
    consortium.freeze_after_registering(3)
    consortium.wait_for_attempt(1)
    consortium.kill(consortium.silos[3])  # a participant of round 1, killed before it answered
    assert consortium.wait_aggregator(timeout=180) == 0
    rounds = contributors(consortium)
    assert rounds[1] == ["silo-0", "silo-1", "silo-2"]
    assert rounds[2] == ["silo-0", "silo-1", "silo-2"]


@HEAVY
def test_round_is_retried_when_too_few_remain(make_consortium):
    consortium = make_consortium(rounds=1, min_silos=3, round_timeout=6.0)
    consortium.start()
    consortium.freeze_after_registering(2)
    consortium.wait_for_output(lambda line: "aborted" in line, timeout=60)
    consortium.kill(consortium.silos[2])
    consortium.start_silo(2)
    assert consortium.wait_aggregator(timeout=180) == 0
    store = consortium.store()
    statuses = store._db.execute("SELECT round, status FROM attempts ORDER BY round, attempt").fetchall()
    store.close()
    assert statuses[0] == (1, "aborted")
    assert statuses[-1] == (1, "committed")
    assert contributors(consortium)[1] == ["silo-0", "silo-1", "silo-2"]


def test_silo_and_aggregator_stop_cleanly_when_the_operator_stops_them(make_consortium):
    """SIGTERM (systemctl stop, Ctrl-C): exit 0 promptly, say so, and no retry warning or traceback."""
    consortium = make_consortium(rounds=1, min_silos=3)
    consortium.start_aggregator()
    consortium.start_silo(0)
    consortium.wait_for_silo_log(0, "registered as")
    consortium.silos[0].send_signal(signal.SIGTERM)
    assert consortium.silos[0].wait(10) == 0
    log = (consortium.directory / "silo-0.log").read_text()
    assert "stopped on request" in log
    assert "connection problem" not in log
    assert "Traceback" not in log
    consortium.aggregator.send_signal(signal.SIGTERM)
    assert consortium.wait_aggregator(timeout=10) == 0
    assert "stopped after round 0" in consortium.output
    assert not any("Traceback" in line for line in consortium.output)


@HEAVY  # and twenty kills across every stage in tests/test_fault_injection.py
def test_aggregator_killed_mid_run_resumes_to_the_same_model(make_consortium, tmp_path):
    consortium = make_consortium(rounds=3, min_silos=3)
    consortium.start()
    consortium.wait_for_output(lambda line: line.startswith("round    1/3"), timeout=120)
    consortium.kill(consortium.aggregator)
    consortium.output.clear()
    consortium.start_aggregator()
    assert consortium.wait_aggregator(timeout=180) == 0
    store = consortium.store()
    events = [r.event for r in store.audit_log()]
    committed = [r for (r,) in store._db.execute("SELECT round FROM states ORDER BY round")]
    store.close()
    assert committed == [0, 1, 2, 3], "no round lost or repeated"
    assert events.count("round_committed") == 3
    assert_same_model(consortium.final_state(), simulated_state(tmp_path, rounds=3))


@pytest.mark.parametrize(
    ("drill", "counted"),
    [
        ("masked", 4),  # left after its masked input: still summed, its self mask rebuilt from peers' shares
        ("shares", 3),  # left before it: left out, the masks others made with it rebuilt from its mask key
    ],
)
@HEAVY  # and silos killed after every message of a sum in tests/test_fault_injection.py
def test_secure_round_recovers_a_silo_killed_mid_protocol(make_consortium, tmp_path, drill, counted):
    consortium = make_consortium(rounds=1, min_silos=3, silos=4)  # threshold 3 of 4: one may leave
    consortium.start(drills={3: drill})
    consortium.wait_for_silo_log(3, "drill: stopping", timeout=120)
    consortium.kill(consortium.silos[3])
    assert consortium.wait_aggregator(timeout=180) == 0
    assert contributors(consortium)[1] == [f"silo-{k}" for k in range(counted)]
    if counted == 4:  # the unmasked sum is exactly the full one
        assert_same_model(consortium.final_state(), simulated_state(tmp_path, rounds=1, silos=4), atol=0)
