"""CReFF's mathematics: the matching loss, its feature gradients, and a server step that sees only sums."""

import numpy as np
import pytest
import torch

from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.data.arrays import LabeledData
from fedlt.methods import ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.creff import CReFF, CReFFOptions
from fedlt.methods.heads import head_of

SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)
TRAIN = TrainConfig(local_epochs=1, batch_size=8, lr=0.1)


def _creff(**options):
    defaults = {"features_per_class": 5, "match_steps": 10, "retrain_epochs": 3}
    return CReFF(options=CReFFOptions(**{**defaults, **options}), train=TRAIN, model=SPEC, rounds=3)


def _silo(labels, seed):
    rng = np.random.default_rng(seed)
    x = rng.random((len(labels), 1, 8, 8), dtype=np.float32)
    return LabeledData(x, np.asarray(labels, dtype=np.int64), tuple("abcd"))


def _synthetic_gradient(method, features, head, label):
    """Eq. 5 by autograd through a real nn.Linear, independent of the closed form the method uses."""
    linear = torch.nn.Linear(features.shape[1], 4).double()
    linear.weight.data, linear.bias.data = head[0].double().clone(), head[1].double().clone()
    loss = torch.nn.functional.cross_entropy(linear(features), torch.full((len(features),), label))
    grad_w, grad_b = torch.autograd.grad(loss, [linear.weight, linear.bias])
    return torch.cat([grad_w, grad_b[:, None]], dim=1)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_matching_loss_is_zero_for_identical_gradients(reduction):
    method = _creff(row_reduction=reduction)
    g = torch.Generator().manual_seed(0)
    head = (
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(4, generator=g, dtype=torch.float64),
    )
    synthetic = torch.randn(2, 7, 6, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, 3])
    real = torch.stack(
        [_synthetic_gradient(method, synthetic[i], head, int(c)) for i, c in enumerate(labels)]
    )
    # zero up to the official loss's 1e-6 guard in the cosine denominators
    assert method.matching_loss(synthetic, head, real, labels).item() == pytest.approx(0.0, abs=1e-3)
    # and a different real gradient gives a clearly positive loss
    assert method.matching_loss(synthetic, head, -real, labels).item() > 1.0


def test_matching_loss_is_the_per_row_cosine_distance_of_eq_6():
    method = _creff(row_reduction="mean")
    g = torch.Generator().manual_seed(1)
    head = (
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(4, generator=g, dtype=torch.float64),
    )
    synthetic = torch.randn(1, 5, 6, generator=g, dtype=torch.float64)
    real = torch.randn(1, 4, 7, generator=g, dtype=torch.float64)
    fed = _synthetic_gradient(method, synthetic[0], head, 2)
    cos = torch.nn.functional.cosine_similarity
    rows = (1 - cos(fed[:, :-1], real[0, :, :-1], dim=1)).mean()
    bias = 1 - cos(fed[:, -1], real[0, :, -1], dim=0)
    loss = method.matching_loss(synthetic, head, real, torch.tensor([2]))
    assert loss.item() == pytest.approx((rows + bias).item(), rel=1e-5)


def test_feature_gradients_of_the_matching_loss_pass_a_finite_difference_check():
    method = _creff()
    g = torch.Generator().manual_seed(2)
    head = (
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(4, generator=g, dtype=torch.float64),
    )
    real = torch.randn(2, 4, 7, generator=g, dtype=torch.float64)
    synthetic = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 2])
    assert torch.autograd.gradcheck(
        lambda s: method.matching_loss(s, head, real, labels), (synthetic,), eps=1e-6, atol=1e-5
    )


def _round(method, state, silos, layer=None):
    layer = layer or PlaintextSum()
    contributions = [
        method.local_round(state, data, SiloContext(1, f"silo-{k}", 0)) for k, data in enumerate(silos)
    ]
    return contributions, layer


def test_silos_contribute_head_gradients_of_their_classes_only_and_mark_them_per_class():
    method = _creff()
    state = method.init_state(seed=0)
    schema = method.schema(state)
    assert {f.name for f in schema.fields if f.per_class} == {"grad", "present"}
    c = method.local_round(state, _silo([0, 0, 2, 2, 2], 0), SiloContext(1, "silo-0", 0))
    assert c.values["present"].tolist() == [1.0, 0.0, 1.0, 0.0]
    grads = c.values["grad"].reshape(4, 4, -1)
    assert grads[1].abs().max() == 0
    assert grads[3].abs().max() == 0
    assert grads[0].abs().max() > 0


def test_server_step_is_a_function_of_the_sums_alone():
    """Two different sets of silo contributions with the same sums give the same next state."""
    method = _creff()
    state = method.init_state(seed=0)
    schema = method.schema(state)
    real = [
        method.local_round(state, _silo(labels, k), SiloContext(1, f"silo-{k}", 0))
        for k, labels in enumerate([[0, 0, 1, 1, 1, 0], [1, 1, 2, 2, 2, 2], [0, 3, 3, 0, 3, 3]])
    ]
    # dyadic values add exactly in float64, so any split of them has bit-identical sums
    exact = [{k: torch.round(v * 2**20) / 2**20 for k, v in c.values.items()} for c in real]
    g = torch.Generator().manual_seed(3)
    share = {
        k: torch.round(torch.rand(v.shape, generator=g, dtype=torch.float64) * 2**10) / 2**20
        for k, v in exact[0].items()
    }
    first = [schema.contribution(**values) for values in exact]
    second = [
        schema.contribution(**{k: exact[0][k] - share[k] for k in share}),
        schema.contribution(**exact[2]),
        schema.contribution(**share),
        schema.contribution(**exact[1]),
    ]
    a, b = PlaintextSum().aggregate(schema, first), PlaintextSum().aggregate(schema, second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a.contributors != b.contributors
    ctx = ServerContext(1, 0)
    assert method.server_step(state, a, ctx).digest() == method.server_step(state, b, ctx).digest()
    with pytest.raises(TypeError):
        method.server_step(state, {k: a[k] for k in a}, ctx)


def test_a_round_matches_features_of_held_classes_and_retrains_the_evaluated_head():
    method = _creff(match_steps=20)
    state = method.init_state(seed=0)
    silos = [_silo([0, 0, 1, 1, 0, 1, 0], 0), _silo([1, 1, 0, 1, 1, 0], 1)]  # classes 2 and 3 held by nobody
    contributions, layer = _round(method, state, silos)
    sums = layer.aggregate(method.schema(state), contributions)
    new = method.server_step(state, sums, ServerContext(1, 0))
    before = state.extra["features"].reshape(4, 5, -1)
    after = new.extra["features"].reshape(4, 5, -1)
    assert not torch.equal(before[0], after[0])
    assert not torch.equal(before[1], after[1])
    assert torch.equal(before[2], after[2])
    assert torch.equal(before[3], after[3])
    # matching lowered the loss the features were optimised for
    head = state.extra["head.weight"], state.extra["head.bias"]
    real = (sums["grad"].reshape(4, 4, -1)[:2] / sums["present"][:2, None, None]).float()
    labels = torch.tensor([0, 1])
    assert method.matching_loss(after[:2], head, real, labels) < method.matching_loss(
        before[:2], head, real, labels
    )
    # evaluated: FedAvg backbone, re-trained head
    evaluated = method.eval_model(new)
    assert torch.equal(evaluated.encoder[0].weight, new.model["encoder.0.weight"])
    weight, bias = head_of(evaluated)
    assert torch.equal(weight, new.extra["head.weight"])
    assert torch.equal(bias, new.extra["head.bias"])
    assert not torch.equal(new.extra["head.weight"], new.model["classifier.weight"])
