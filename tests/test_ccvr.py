"""CCVR: statistics as sums, the post-hoc phase after training, and the calibrated head it evaluates."""

import pytest
import torch

from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.methods import ServerContext, SiloContext, TrainConfig
from fedlt.methods.ccvr import CCVR, CCVROptions
from fedlt.methods.feature_stats import ClassGaussians
from fedlt.methods.heads import extract_features, head_of
from fedlt.methods.posthoc import CLOSING
from tests.method_harness import SPEC, plaintext_step, tiny_silos

TRAIN = TrainConfig(local_epochs=1, batch_size=8, lr=0.1)


def _ccvr(rounds=2, **options):
    defaults = {"virtual_per_class": 50, "calibrate_epochs": 2}
    return CCVR(options=CCVROptions(**{**defaults, **options}), train=TRAIN, model=SPEC, rounds=rounds)


def test_post_hoc_calibration_is_one_closing_round_on_the_final_encoder():
    method, silos = _ccvr(rounds=2), tiny_silos()
    state = method.init_state(seed=0)
    assert method.remaining_rounds(state) == 3
    for r in (1, 2):
        assert method.schema(state).phase == "train"
        assert {f.name for f in method.schema(state).fields} == {"delta", "n"}
        state = plaintext_step(method, state, silos, r)
        assert "head.weight" not in state.extra
    schema = method.schema(state)
    assert schema.phase == CLOSING
    assert {f.name for f in schema.fields if f.per_class} == {"feature_sum", "outer_sum", "count"}
    assert {f.name for f in schema.fields} == {"feature_sum", "outer_sum", "count"}
    calibrated = plaintext_step(method, state, silos, 3)
    assert calibrated.round == 3
    assert method.remaining_rounds(calibrated) == 0
    assert all(torch.equal(calibrated.model[k], state.model[k]) for k in state.model)  # training is over
    weight, bias = head_of(method.eval_model(calibrated))
    assert torch.equal(weight, calibrated.extra["head.weight"])
    assert torch.equal(bias, calibrated.extra["head.bias"])
    assert not torch.equal(weight, state.model["classifier.weight"])


def test_silo_statistics_are_sums_of_the_final_encoders_features():
    method, silos = _ccvr(rounds=1), tiny_silos()
    state = plaintext_step(method, method.init_state(seed=0), silos, 1)
    contributions = [
        method.local_round(state, d, SiloContext(2, f"silo-{k}", 0)) for k, d in enumerate(silos)
    ]
    sums = PlaintextSum().aggregate(method.schema(state), contributions)
    pooled = ClassGaussians.from_sums(sums["feature_sum"], sums["outer_sum"], sums["count"])
    model = method.load(state.model)
    z = torch.cat([extract_features(model, torch.from_numpy(d.x)) for d in silos]).double()
    y = torch.cat([torch.from_numpy(d.y) for d in silos])
    assert pooled.counts.tolist() == [8, 7, 6, 0]
    for c in range(3):
        assert torch.allclose(pooled.means[c], z[y == c].mean(0), atol=1e-6)
        assert torch.allclose(pooled.covariances[c], torch.cov(z[y == c].T), atol=1e-6)


def test_every_round_option_carries_statistics_in_training_rounds():
    method, silos = _ccvr(rounds=2, calibrate="every-round"), tiny_silos()
    state = method.init_state(seed=0)
    assert method.remaining_rounds(state) == 2
    assert {f.name for f in method.schema(state).fields} == {
        "delta",
        "n",
        "feature_sum",
        "outer_sum",
        "count",
    }
    new = plaintext_step(method, state, silos, 1)
    assert new.round == 1
    assert "head.weight" in new.extra
    assert not torch.equal(new.model["encoder.0.weight"], state.model["encoder.0.weight"])  # FedAvg moved on


def test_calibration_refuses_sums_without_any_class():
    method = _ccvr(rounds=1)
    state = method.init_state(seed=0)
    state = type(state)(1, state.model, {"trained": torch.tensor(1)})
    schema = method.schema(state)
    empty = schema.contribution(**{f.name: torch.zeros(f.shape) for f in schema.fields})
    with pytest.raises(Exception, match="no class has any feature statistics"):
        method.server_step(state, PlaintextSum().aggregate(schema, [empty]), ServerContext(2, 0))
