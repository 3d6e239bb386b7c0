import contextlib
import json
import math
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlt.dp import DPSettings
from fedlt.methods import ModelSpec, SiloContext, TrainConfig
from fedlt.methods.base import reported_counts
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from privacy.dp.accountant import ORDERS, epsilon, gaussian_rdp, sgd_rdp
from privacy.dp.ledger import Budget, BudgetExceeded, LedgerError, PrivacyLedger
from privacy.dp.noise import SecureRandom
from privacy.dp.silo_privacy import SiloPrivacy

BUDGET = Budget(1.0, 1e-5)
ROOMY = Budget(100.0, 1e-5)  # for tests of what is charged, not of the budget
SMALL = gaussian_rdp(noise_multiplier=8.0)  # ε ≈ 0.46 alone at δ = 1e-5
LARGE = gaussian_rdp(noise_multiplier=2.0)  # ε ≈ 2.7 alone: past BUDGET on its own
COUNTS = np.array([30, 12, 5, 0, 3, 9, 20, 1, 7, 13])


def _refused(ledger: PrivacyLedger, rdp: np.ndarray, what: str = "too much") -> BudgetExceeded:
    with pytest.raises(BudgetExceeded) as refusal:
        ledger.charge("gaussian", rdp, what=what)
    return refusal.value


# ---------------------------------------------------------------- charging


@pytest.mark.parametrize("on_disk", [False, True])
def test_charge_records_then_refuses_past_the_budget(tmp_path, on_disk):
    """Guards the ledger's one job: work within the budget is recorded with its cost, work past it is refused
    with BudgetExceeded naming the budget, and a refusal records nothing, in memory or on disk."""
    path = tmp_path / "ledger.json" if on_disk else None
    ledger = PrivacyLedger(BUDGET, path)
    entry = ledger.charge("gaussian", SMALL, what="record count", std=8.0)
    assert entry["mechanism"] == "gaussian"
    assert entry["what"] == "record count"
    assert entry["params"] == {"std": 8.0}
    assert entry["epsilon_after"] == pytest.approx(epsilon(SMALL, 1e-5))
    assert ledger.spent() == pytest.approx(epsilon(SMALL, 1e-5))
    assert ledger.remaining() == pytest.approx(1.0 - ledger.spent())

    saved = path.read_bytes() if on_disk else None
    refusal = _refused(ledger, SMALL + LARGE, what="local training (50 steps)")
    assert "budget of ε = 1" in str(refusal)
    assert "local training (50 steps)" in str(refusal)
    assert len(ledger.entries) == 1
    assert ledger.spent() == pytest.approx(epsilon(SMALL, 1e-5))
    if on_disk:
        assert path.read_bytes() == saved


def test_charges_add_up_to_exactly_what_fits():
    """Guards composition in the ledger: identical charges are admitted while their RDP sum fits in ε, and the
    first that would not is refused (not one more, not one fewer)."""
    ledger = PrivacyLedger(Budget(3.0, 1e-5))
    fitting = max(k for k in range(1, 50) if epsilon(k * SMALL, 1e-5) <= 3.0)
    for _ in range(fitting):
        ledger.charge("gaussian", SMALL, what="a release")
    _refused(ledger, SMALL)
    assert len(ledger.entries) == fitting
    np.testing.assert_allclose(ledger.spent_rdp(), fitting * SMALL)


def test_concurrent_charges_never_overspend():
    """Guards the check-then-record race: many threads charging at once are admitted exactly as often as
    one thread would be, so two silo threads cannot both take the last of the budget."""
    ledger = PrivacyLedger(Budget(3.0, 1e-5))
    fitting = max(k for k in range(1, 50) if epsilon(k * SMALL, 1e-5) <= 3.0)
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(fitting):
            with contextlib.suppress(BudgetExceeded):
                ledger.charge("gaussian", SMALL, what="a release")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ledger.entries) == fitting
    assert ledger.spent() <= 3.0


def test_charge_refuses_a_curve_over_other_orders():
    """Guards against adding curves that do not line up order by order."""
    with pytest.raises(ValueError, match="orders"):
        PrivacyLedger(BUDGET).charge("gaussian", SMALL[:-1], what="x")


def test_charge_refuses_a_curve_that_is_not_a_cost():
    """Guards the ledger against a caller's bug turning into spending the budget twice: an RDP curve is
    >= 0 at every order, and a negative one would lower the recorded total (a refund)."""
    ledger = PrivacyLedger(BUDGET)
    ledger.charge("gaussian", SMALL, what="a release")
    with pytest.raises(ValueError, match="RDP"):
        ledger.charge("gaussian", np.full(len(ORDERS), -1e3), what="not a cost")
    assert ledger.spent() == pytest.approx(epsilon(SMALL, 1e-5))


@pytest.mark.parametrize(
    ("eps", "delta"), [(0.0, 1e-5), (-1.0, 1e-5), (1.0, 0.0), (1.0, 1.0), (math.nan, 1e-5)]
)
def test_budget_refuses_meaningless_values(eps, delta):
    """Guards against a budget that admits all or nothing by accident (ε <= 0, NaN, δ outside (0, 1))."""
    with pytest.raises(ValueError, match="budget"):
        Budget(eps, delta)


# ---------------------------------------------------------------- on disk


def test_ledger_survives_a_restart(tmp_path):
    """Guards against a restarted silo forgetting what it spent: a new ledger on the same file has the same
    entries and total, and refuses the same over-budget charge."""
    path = tmp_path / "silo" / "ledger.json"  # the directory is made on first charge
    first = PrivacyLedger(BUDGET, path)
    first.charge("gaussian", SMALL, what="record count")
    _refused(first, 2 * LARGE)

    restarted = PrivacyLedger(BUDGET, path)
    assert restarted.entries == first.entries
    assert restarted.spent() == first.spent()
    _refused(restarted, 2 * LARGE)
    restarted.charge("gaussian", 0.01 * SMALL, what="a small release")
    assert len(PrivacyLedger(BUDGET, path).entries) == 2


def _valid_ledger(tmp_path) -> str:
    ledger = PrivacyLedger(BUDGET, tmp_path / "valid.json")
    ledger.charge("gaussian", SMALL, what="record count")
    return (tmp_path / "valid.json").read_text()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda valid: "",
        lambda valid: "not json at all",
        lambda valid: valid[: len(valid) // 2],  # a torn write
        lambda valid: json.dumps([json.loads(valid)]),
        lambda valid: json.dumps({**json.loads(valid), "format": 2}),
        lambda valid: json.dumps({**json.loads(valid), "orders": list(ORDERS[:-1])}),
        lambda valid: json.dumps({k: v for k, v in json.loads(valid).items() if k != "format"}),
    ],
    ids=["empty", "not-json", "truncated", "list", "other-format", "other-orders", "no-format"],
)
def test_unreadable_ledger_is_an_error_never_a_fresh_start(tmp_path, corrupt):
    """Guards against a damaged ledger being silently replaced by an empty one (which would reset the
    silo's spending): opening it raises LedgerError and leaves the file as it was."""
    path = tmp_path / "ledger.json"
    path.write_text(corrupt(_valid_ledger(tmp_path)))
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="restore it from a backup"):
        PrivacyLedger(BUDGET, path)
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "damage",
    [
        lambda saved: saved.pop("entries"),
        lambda saved: saved.update(entries="abc"),
        lambda saved: saved["entries"][0].pop("rdp"),
        lambda saved: saved["entries"][0].update(rdp=[1.0, 2.0]),
        lambda saved: saved["entries"][0].update(rdp=["x"] * len(ORDERS)),
    ],
    ids=["no-entries", "entries-not-a-list", "entry-without-rdp", "short-rdp", "rdp-not-numbers"],
)
def test_ledger_with_malformed_entries_is_a_ledger_error(tmp_path, damage):
    """Guards the same as above for a file of the right format whose entries are damaged: it must be a
    LedgerError when opened (a clear 'restore it from a backup'), not a crash at some later charge."""
    saved = json.loads(_valid_ledger(tmp_path))
    damage(saved)
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(saved))
    with pytest.raises(LedgerError):
        PrivacyLedger(BUDGET, path).spent()


# ---------------------------------------------------------------- SiloPrivacy: the noised counts


def _settings(**overrides) -> DPSettings:
    values = {"enabled": True, "epsilon": 8.0, "delta": 1e-5, "noise_multiplier": 1.0, "count_noise": 10.0}
    return DPSettings(**(values | overrides))


def _method(rounds: int = 1) -> FedAvg:
    return FedAvg(
        options=FedAvgOptions(),
        train=TrainConfig(),
        model=ModelSpec("cnn-small", (1, 8, 8), 10),
        rounds=rounds,
    )


def _silo(settings: DPSettings, path=None, seed: int = 1, rounds: int = 1, budget: Budget | None = None):
    ledger = PrivacyLedger(budget or Budget(settings.epsilon, settings.delta), path)
    return SiloPrivacy(settings, method=_method(rounds), ledger=ledger, rng=SecureRandom.seeded(seed))


def _count_entries(silo: SiloPrivacy) -> list[dict]:
    return [e for e in silo.ledger.entries if e["mechanism"] == "gaussian"]


def test_counts_are_noised_once_and_reused_across_calls_and_restarts(tmp_path):
    """Guards against paying for the count (or releasing a fresh noisy copy, which averages the noise away)
    on every call: one charge per data set, the same numbers afterwards and after a restart with another
    CSPRNG state; a changed data set is a new release, charged again."""
    path = tmp_path / "ledger.json"
    silo = _silo(_settings(), path, seed=1)
    first = silo.reported_counts(COUNTS)
    np.testing.assert_array_equal(silo.reported_counts(COUNTS), first)
    assert len(_count_entries(silo)) == 1
    assert _count_entries(silo)[0]["rdp"] == pytest.approx(list(gaussian_rdp(noise_multiplier=10.0)))

    restarted = _silo(_settings(), path, seed=2)
    np.testing.assert_array_equal(restarted.reported_counts(COUNTS), first)
    assert len(_count_entries(restarted)) == 1

    grown = COUNTS + np.eye(len(COUNTS), dtype=np.int64)[4]
    again = restarted.reported_counts(grown)
    assert not np.array_equal(again, first)
    assert len(_count_entries(restarted)) == 2
    np.testing.assert_array_equal(restarted.reported_counts(grown), again)
    assert len(_count_entries(restarted)) == 2


def test_a_release_made_once_is_found_by_its_params_whichever_run_or_writer_made_it(tmp_path):
    """Guards `once_per`: another writer's entry for the same records (another run tag, written after this
    object last read the file) is returned and nothing is charged; other records are a new release, and a
    charge without `once_per` is charged again whatever is recorded."""
    path = tmp_path / "ledger.json"
    this, other = PrivacyLedger(BUDGET, path), PrivacyLedger(BUDGET, path)
    made = other.charge(
        "gaussian", SMALL / 4, what="class counts", run="b", records=[1, 2], reported=[1.5, 2]
    )
    found = this.charge(
        "gaussian", SMALL / 4, what="class counts", run="a", once_per=("records",), records=[1, 2]
    )
    assert found == made
    assert len(PrivacyLedger(BUDGET, path).entries) == 1
    this.charge("gaussian", SMALL / 4, what="class counts", run="a", once_per=("records",), records=[2, 1])
    this.charge("gaussian", SMALL / 4, what="class counts", run="a", records=[1, 2])
    assert [e["params"]["records"] for e in PrivacyLedger(BUDGET, path).entries] == [[1, 2], [2, 1], [1, 2]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 2), st.booleans()), min_size=1, max_size=8)
)
def test_each_datas_counts_are_noised_once_across_studies_and_restarts(reports):
    """The property finding 3 broke: studies' agents (each with its own ledger object on the silo's one
    file, each restarted at will) report the counts of any of three data sets in any order, charging DP-SGD
    in between: each data set's counts are charged once and reported as the same numbers every time."""
    data = [COUNTS, COUNTS[::-1].copy(), COUNTS + 1]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ledger.json"

        def agent(study: str, seed: int) -> SiloPrivacy:
            ledger = PrivacyLedger(ROOMY, path)
            return SiloPrivacy(
                _settings(), method=_method(), ledger=ledger, rng=SecureRandom.seeded(seed), run=study
            )

        agents = {"a": agent("a", 1), "b": agent("b", 2)}
        seen: dict[int, set] = {}
        for k, (study, which, restarted) in enumerate(reports):
            if restarted:
                agents[study] = agent(study, 10 + k)
            seen.setdefault(which, set()).add(tuple(agents[study].reported_counts(data[which])))
            agents[study].admit_sgd(sample_rate=0.1, steps=1)
        entries = PrivacyLedger(ROOMY, path).entries
    charged = sorted(tuple(e["params"]["records"]) for e in entries if e["mechanism"] == "gaussian")
    assert charged == sorted(tuple(int(c) for c in data[which]) for which in seen)
    assert all(len(values) == 1 for values in seen.values())


def test_two_agents_reporting_the_same_counts_at_once_charge_them_once(tmp_path):
    """Finding and charging are one hold of the file's lock: two studies' agents over the same data that
    report its counts at the same moment release one noised copy, not two."""
    path = tmp_path / "ledger.json"
    agents = [
        SiloPrivacy(
            _settings(), method=_method(), ledger=PrivacyLedger(ROOMY, path), rng=SecureRandom.seeded(s)
        )
        for s in (1, 2)
    ]
    start, reported = threading.Barrier(len(agents)), []

    def report(agent: SiloPrivacy) -> None:
        start.wait()
        reported.append(tuple(agent.reported_counts(COUNTS)))

    threads = [threading.Thread(target=report, args=(agent,)) for agent in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reported) == 2
    assert len(set(reported)) == 1
    assert len(PrivacyLedger(ROOMY, path).entries) == 1


def test_counts_are_noisy_at_the_set_scale():
    """Guards against the true counts leaking: the reported counts differ from the truth, by noise of the
    configured std (a few seeds, 10 classes each: the sample std within a factor 1.5 of count_noise)."""
    errors = np.concatenate(
        [_silo(_settings(count_noise=10.0), seed=s).reported_counts(COUNTS) - COUNTS for s in range(6)]
    )
    assert np.count_nonzero(errors) >= len(errors) - 2
    assert 10.0 / 1.5 < errors.std() < 10.0 * 1.5


def test_released_counts_are_never_negative():
    """Guards the released form: noise can push a small class below zero, but what a method sends is the
    noisy counts clamped at 0 (float64), nothing else of the truth."""
    silo = _silo(_settings(count_noise=10.0), seed=0)
    raw = silo.reported_counts(COUNTS)
    assert (raw < 0).any()  # this seed pushes some classes below zero
    released = reported_counts(COUNTS, SiloContext(1, "silo-0", 0, private=silo))
    assert released.dtype == torch.float64
    np.testing.assert_array_equal(released.numpy(), np.maximum(raw, 0))


# ---------------------------------------------------------------- SiloPrivacy: σ from the plan


@pytest.mark.parametrize(("plan_eps", "budget_eps"), [(2.0, None), (5.0, 2.0)])
def test_calibrated_sigma_spends_the_plan_and_no_more(tmp_path, plan_eps, budget_eps):
    """Guards σ calibration (noise_multiplier = 0): the planned rounds' DP-SGD plus the count release land
    within the target ε = min(plan ε, budget ε) and close to it (> 0.95 of it: no noise wasted); a round
    beyond the plan is refused by the ledger, also after a restart, which picks the same σ."""
    settings = _settings(epsilon=plan_eps, noise_multiplier=0.0)
    budget = Budget(budget_eps or plan_eps, 1e-5)
    path = tmp_path / "ledger.json"
    rate, steps, rounds = 1 / 20, 20, 3  # a sampling rate of one record in twenty
    silo = _silo(settings, path, rounds=rounds, budget=budget)
    sigma = silo.noise_multiplier(sample_rate=rate, steps=steps)
    for r in range(rounds):
        assert silo.admit_sgd(sample_rate=rate, steps=steps) == sigma
        if r == 0:
            silo.reported_counts(COUNTS)  # FedAvg's first round releases the counts after training
    target = 2.0
    spent = silo.ledger.spent()
    assert 0.95 * target < spent <= target
    expected = gaussian_rdp(noise_multiplier=10.0) + sgd_rdp(
        sample_rate=rate, noise_multiplier=sigma, steps=rounds * steps
    )
    assert spent == pytest.approx(epsilon(expected, 1e-5), rel=1e-9)

    with pytest.raises(BudgetExceeded, match="budget"):
        silo.admit_sgd(sample_rate=rate, steps=steps)
    restarted = _silo(settings, path, seed=9, rounds=rounds, budget=budget)
    assert restarted.noise_multiplier(sample_rate=rate, steps=steps) == sigma
    with pytest.raises(BudgetExceeded):
        restarted.admit_sgd(sample_rate=rate, steps=steps)
    assert len(restarted.ledger.entries) == rounds + 1


def test_a_set_noise_multiplier_is_used_as_is():
    """Guards the other branch: a plan's σ > 0 is taken as given and charged at that σ."""
    silo = _silo(_settings(noise_multiplier=1.3))
    assert silo.admit_sgd(sample_rate=0.1, steps=7) == 1.3
    (entry,) = silo.ledger.entries
    assert entry["params"]["noise_multiplier"] == 1.3
    assert entry["params"]["steps"] == 7
    np.testing.assert_allclose(entry["rdp"], sgd_rdp(sample_rate=0.1, noise_multiplier=1.3, steps=7))


def test_a_later_run_calibrates_to_what_earlier_runs_left():
    """Guards σ against a silo's earlier spending: after one run spent about ε = 2 of a budget of 2.5, a
    second run of the same plan (ε = 2) picks a larger σ so that all its rounds fit in what is left, instead
    of being refused half-way; a restart of that run picks the same σ (its own entries are not 'earlier')."""
    settings = _settings(epsilon=2.0, noise_multiplier=0.0)
    budget = Budget(2.5, 1e-5)
    rate, steps, rounds = 1 / 20, 20, 3

    def run(tag: str, ledger: PrivacyLedger, seed: int) -> SiloPrivacy:
        return SiloPrivacy(
            settings, method=_method(rounds), ledger=ledger, rng=SecureRandom.seeded(seed), run=tag
        )

    first = run("plan-a", PrivacyLedger(budget), 1)
    sigma_a = first.noise_multiplier(sample_rate=rate, steps=steps)
    for _ in range(rounds):
        first.admit_sgd(sample_rate=rate, steps=steps)
    first.reported_counts(COUNTS)
    assert 1.9 < first.ledger.spent() <= 2.0

    second = run("plan-b", first.ledger, 2)
    sigma_b = second.noise_multiplier(sample_rate=rate, steps=steps)
    assert sigma_b > sigma_a
    for _ in range(rounds):
        assert second.admit_sgd(sample_rate=rate, steps=steps) == sigma_b
    assert 0.95 * 2.5 < second.ledger.spent() <= 2.5
    assert {e["run"] for e in second.ledger.entries} == {"plan-a", "plan-b"}
    restarted = run("plan-b", second.ledger, 3)
    assert restarted.noise_multiplier(sample_rate=rate, steps=steps) == sigma_b


def test_an_in_memory_ledger_pickles_and_one_on_disk_does_not(tmp_path):
    """A simulated silo's ledger moves with its work (the Ray backend); a file's ledger must be opened where
    it lies, or two processes would each think they hold the silo's spending."""
    import pickle

    memory = PrivacyLedger(Budget(8.0, 1e-5))
    memory.charge("gaussian", SMALL, what="counts")
    moved = pickle.loads(pickle.dumps(memory))
    assert moved.entries == memory.entries
    assert moved.spent() == memory.spent()
    moved.charge("gaussian", SMALL, what="more")  # its lock came back with it
    assert moved.spent() > memory.spent()
    with pytest.raises(TypeError, match="stays with its file"):
        pickle.dumps(PrivacyLedger(Budget(8.0, 1e-5), tmp_path / "ledger.json"))
