"""Whole simulated runs under `[dp]`: what each silo spends, round by round, in the metrics and in the
checkpoint's ledgers; a resume that remembers it; and the methods' own refusals and models under DP.

Training is full-batch (batch_size above any silo's size): the sample rate is 1, so every silo calibrates the
same DP-SGD σ without subsampling, in milliseconds instead of the seconds Opacus' subsampled RDP takes per
silo on this machine. Each silo's noise comes from a seeded stream (`_seeded_streams`).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from torch import nn

from fedlt.aggregation import make_layer
from fedlt.data.arrays import LabeledData
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.methods import GlobalState, ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.sfd import SFD, SFDOptions
from fedlt.sim import run
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import CHECKPOINT, make_method, run_simulation
from privacy.dp.accountant import epsilon
from privacy.dp.ledger import Budget, BudgetExceeded, PrivacyLedger
from privacy.dp.noise import SecureRandom
from privacy.dp.silo_privacy import SiloPrivacy

EPSILON = 4.0
DATA = {"dataset": "digits", "silos": 3, "rounds": 2, "imbalance": 10.0, "alpha": 0.5}
FLAGS = {**DATA, "epsilon": EPSILON}  # the --epsilon flag turns [dp] on too
# CReFF's server half at a size that takes a fraction of a second
QUICK = {"creff": {"features_per_class": 10, "match_steps": 5, "retrain_epochs": 5}}
SFD_QUICK = {
    "rff_features": 200,
    "synthesis_steps": 2,
    "finetune_epochs": 1,
    "synthetic_fewest": 150,  # the aligner needs more than cnn-small's 128 feature dimensions
    "synthetic_most": 200,
}
SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)


@pytest.fixture(scope="module", autouse=True)
def _seeded_streams():
    """Every simulated silo's SiloPrivacy as the simulator makes it, but drawing from a seeded stream."""
    made = itertools.count()
    original = run.silo_privacy

    def seeded(*args, **kwargs):
        private = original(*args, **kwargs)
        private.rng = SecureRandom.seeded(f"dp-sim/{next(made)}")
        return private

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run, "silo_privacy", seeded)
        yield


def _config(method: str = "fedavg", **flags):
    return load_sim_config(
        None,
        {**FLAGS, "method": method, **flags},
        tables={"dp": {"enabled": True}, "train": {"batch_size": 4096}, "method": QUICK.get(method, {})},
    )


def _quiet(_line: str) -> None:
    pass


def _ledgers(out) -> dict[str, list[dict]]:
    return json.loads(torch.load(out / CHECKPOINT, weights_only=True)["ledgers"])


def _spent(entries: list[dict]) -> float:
    return epsilon(np.sum([e["rdp"] for e in entries], axis=0), 1e-5)


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fedavg")
    return out, run_simulation(_config(), out, echo=_quiet)


@pytest.fixture(scope="module")
def creff_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("creff")
    return out, run_simulation(_config("creff"), out, echo=_quiet)


# ---------------------------------------------------------------- what a run spends


@pytest.mark.parametrize("name", ["fedavg", "creff"])
def test_a_run_under_dp_reports_its_spending_every_round_and_spends_its_plan(name, request):
    """Guards epsilon_spent: every round, the most any ledger spent, growing, ≤ ε, and > 0.8 ε at the end."""
    out, result = request.getfixturevalue(f"{name}_run")
    rounds = result.metrics["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    spent = [r["epsilon_spent"] for r in rounds]
    assert 0 < spent[0] < spent[1] <= EPSILON
    assert spent[1] > 0.8 * EPSILON
    ledgers = _ledgers(out)
    assert sorted(ledgers) == ["silo-0", "silo-1", "silo-2"]
    assert spent[1] == pytest.approx(max(_spent(entries) for entries in ledgers.values()), rel=1e-9)
    assert all(_spent(entries) <= EPSILON for entries in ledgers.values())


def test_creff_charges_its_statistics_in_every_round_and_its_counts_once(creff_run):
    """Guards CReFF's ledgers: DP-SGD and a Skellam release of `grad` per round, the counts once."""
    out, _ = creff_run
    for entries in _ledgers(out).values():
        mechanisms = [e["mechanism"] for e in entries]
        assert mechanisms.count("dp-sgd") == 2
        assert mechanisms.count("gaussian") == 1
        skellam = [e for e in entries if e["mechanism"] == "skellam"]
        assert len(skellam) == 2
        assert all(e["params"]["fields"] == ["grad"] for e in skellam)
        assert all(e["params"]["counted"] == 3 for e in skellam)


def test_fedavg_releases_no_statistic_with_a_sensitivity(fedavg_run):
    """Guards against charging FedAvg's contribution as a statistic: DP-SGD per round and the counts once."""
    out, _ = fedavg_run
    for entries in _ledgers(out).values():
        assert [e["mechanism"] for e in entries] == ["dp-sgd", "gaussian", "dp-sgd"]


def test_the_recipe_trains_its_moved_images_under_dp_sgd(tmp_path):
    """Guards the recipe's shift under DP: each round's moved batches go through DP-SGD (Opacus' per-record
    gradients of an input it did not see) and the counts are charged once, in the priors round."""
    config = _config("balanced", rounds=1)
    assert make_method(config, (1, 8, 8), 10).options.shift > 0
    result = run_simulation(config, tmp_path, echo=_quiet)
    assert [r["round"] for r in result.metrics["rounds"]] == [1, 2]
    for entries in _ledgers(tmp_path).values():
        assert [e["mechanism"] for e in entries] == ["gaussian", "dp-sgd"]


# ---------------------------------------------------------------- resuming


class Interrupted(Exception):
    pass


def _stop_after_round_1(r: int, _total: int, _entry: dict) -> None:
    if r == 1:
        raise Interrupted


def test_a_resumed_run_starts_from_its_silos_saved_ledgers(fedavg_run, tmp_path):
    """Guards the ledgers across a resume: killed after round 1 and resumed, a run spends as a whole one."""
    _, whole = fedavg_run
    with pytest.raises(Interrupted):
        run_simulation(_config(), tmp_path, echo=_quiet, on_round=_stop_after_round_1)
    saved = _ledgers(tmp_path)
    assert all(len(entries) == 2 for entries in saved.values())  # round 1's DP-SGD and the counts
    lines: list[str] = []
    resumed = run_simulation(_config(), tmp_path, echo=lines.append)
    assert lines[0].startswith("resuming")
    spent = [r["epsilon_spent"] for r in resumed.metrics["rounds"]]
    expected = [r["epsilon_spent"] for r in whole.metrics["rounds"]]
    assert spent == pytest.approx(expected, rel=1e-9)
    assert spent[0] < spent[1] <= EPSILON
    for silo, entries in _ledgers(tmp_path).items():
        assert entries[:2] == saved[silo]
        assert [e["mechanism"] for e in entries] == ["dp-sgd", "gaussian", "dp-sgd"]


def test_extending_a_finished_run_past_its_plan_is_refused_by_the_ledger(tmp_path):
    """Guards the budget across an extension: the restored ledgers refuse rounds beyond the spent plan."""
    first = run_simulation(_config(rounds=1), tmp_path, echo=_quiet)
    assert first.metrics["rounds"][-1]["epsilon_spent"] > 0.8 * EPSILON
    with pytest.raises(BudgetExceeded, match="budget"):
        run_simulation(_config(rounds=2), tmp_path, echo=_quiet)
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["round"] == 1
    assert all(_spent(entries) <= EPSILON for entries in _ledgers(tmp_path).values())


# ---------------------------------------------------------------- methods under DP


def _sfd_config(**options):
    return load_sim_config(
        None,
        {**FLAGS, "method": "sfd", "rounds": 1},
        tables={"dp": {"enabled": True}, "train": {"batch_size": 4096}, "method": {**SFD_QUICK, **options}},
    )


def test_sfd_under_dp_refuses_the_default_contrastive_weight(tmp_path):
    """Guards SFD under DP: a ConfigError naming scl_weight at its default; made at scl_weight = 0."""
    with pytest.raises(ConfigError, match="scl_weight"):
        run_simulation(_sfd_config(), tmp_path / "refused", echo=_quiet)
    assert not (tmp_path / "refused").exists()
    method = make_method(_sfd_config(scl_weight=0.0), (1, 8, 8), 10)
    assert isinstance(method, SFD)
    assert method.dp is not None
    assert method.model_spec.private


def _sfd(**options) -> SFD:
    dp = DPSettings(enabled=True, epsilon=EPSILON)
    return SFD(
        options=SFDOptions(**{**SFD_QUICK, "scl_weight": 0.0, **options}),
        train=TrainConfig(batch_size=4096),
        model=SPEC,
        rounds=1,
        dp=dp,
    )


def _private(method, seed: str) -> SiloPrivacy:
    dp = method.dp
    return SiloPrivacy(
        dp, method=method, ledger=PrivacyLedger(Budget(dp.epsilon, dp.delta)), rng=SecureRandom.seeded(seed)
    )


def _images(n: int, seed: int) -> LabeledData:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    return LabeledData(x, rng.integers(0, 4, n).astype(np.int64), ("a", "b", "c", "d"))


def test_sfd_under_dp_with_no_contrastive_term_trains_a_round():
    """Guards the configuration SFD's refusal points to: scl_weight = 0 under DP trains a DP-SGD round."""
    method = _sfd()
    private = _private(method, "sfd-train")
    state = method.init_state(seed=0)
    contribution = method.local_round(state, _images(60, 0), SiloContext(1, "silo-0", 0, private=private))
    assert torch.isfinite(contribution.flat()).all()
    assert "dp-sgd" in [e["mechanism"] for e in private.ledger.entries]


def test_sfd_under_dp_fits_its_head_to_noised_statistics():
    """Guards SFD's closing round under DP against pooled covariances that noise left indefinite."""
    method = _sfd()
    trained = method.init_state(seed=0)
    state = GlobalState(1, trained.model, {"trained": torch.tensor(1)})  # training done: the closing round
    silos = ["silo-0", "silo-1", "silo-2"]
    noise = {u: _private(method, f"sfd-close/{u}") for u in silos}
    contributions = [
        method.local_round(state, _images(80, k), SiloContext(2, u, 0, private=noise[u]))
        for k, u in enumerate(silos)
    ]
    sums = make_layer("plaintext").aggregate(method.schema(state), contributions, silos=silos, noise=noise)
    closed = method.server_step(state, sums, ServerContext(2, 0))
    assert torch.isfinite(closed.extra["head.weight"]).all()


def test_resnet8_under_dp_is_built_with_groupnorm_from_the_config():
    """Guards the path from [dp] in a config to a resnet8 with GroupNorm and no BatchNorm statistics."""
    config = load_sim_config(None, {**FLAGS, "model": "resnet8"}, tables={"dp": {"enabled": True}})
    method = make_method(config, (3, 32, 32), 10)
    kinds = {type(m) for m in method.working_model().modules()}
    assert nn.GroupNorm in kinds
    assert not any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in kinds)
    assert not any("running_mean" in key for key in method.init_state(seed=0).model)
    plain = make_method(load_sim_config(None, {**DATA, "model": "resnet8"}), (3, 32, 32), 10)
    assert plain.dp is None
    assert any("running_mean" in key for key in plain.init_state(seed=0).model)
