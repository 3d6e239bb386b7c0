"""RedGrape: the re-balancing gradient (Eq. 12–13), the balanced set, and persistent prototypes from sums."""

import numpy as np
import torch

from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.data.arrays import LabeledData
from fedlt.methods import ModelSpec, ServerContext, SiloContext, TrainConfig
from fedlt.methods.heads import head_gradient
from fedlt.methods.redgrape import Rebalancing, RedGrape, RedGrapeOptions, balanced_indices, two_stream

SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)
TRAIN = TrainConfig(local_epochs=1, batch_size=8, lr=0.1)


def _redgrape(**options):
    return RedGrape(options=RedGrapeOptions(**options), train=TRAIN, model=SPEC, rounds=3)


def _silo(labels, seed):
    rng = np.random.default_rng(seed)
    x = rng.random((len(labels), 1, 8, 8), dtype=np.float32)
    return LabeledData(x, np.asarray(labels, dtype=np.int64), tuple("abcd"))


def _known_prototypes(classes=4, width=129, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"prototypes": torch.randn(classes, classes, width, generator=g), "known": torch.ones(classes)}


def test_balanced_gradient_has_the_local_gradients_norm_per_tensor():
    method = _redgrape()
    model = method.load(method.init_state(seed=0).model)
    data = _silo([0] * 9 + [1] * 3 + [2] * 8, 0)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    balanced = balanced_indices(y, 8, torch.Generator().manual_seed(0))
    step = Rebalancing(model, x[balanced], y[balanced], _known_prototypes(), lam=0.1, lr=0.1)
    torch.nn.functional.cross_entropy(two_stream(model, x), y).backward()
    step.capture()
    weight_update, bias_update = step.update
    assert torch.allclose(weight_update.norm(), model.classifier.weight.grad.norm())
    assert torch.allclose(bias_update.norm(), model.classifier.bias.grad.norm())


def test_balanced_gradient_mixes_local_classes_with_prototypes_of_the_others_as_eq_12():
    method = _redgrape()
    model = method.load(method.init_state(seed=0).model)
    data = _silo([0] * 8 + [2] * 10 + [3] * 2, 1)  # balanced classes {0, 2}; 3 is below T, 1 missing
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    balanced = balanced_indices(y, 8, torch.Generator().manual_seed(0))
    extra = _known_prototypes()
    step = Rebalancing(model, x[balanced], y[balanced], extra, lam=0.1, lr=0.1)
    model.zero_grad()
    torch.nn.functional.cross_entropy(two_stream(model, x), y).backward()
    step.capture()
    with torch.no_grad():
        head = model.classifier
        h = model.encoder(x[balanced])
        per_class = [
            head_gradient(head.weight, head.bias, h[y[balanced] == c], y[balanced][y[balanced] == c])
            for c in (0, 2)
        ]
        expected = (per_class[0] + per_class[1] + extra["prototypes"][1] + extra["prototypes"][3]) / 4
    direction = torch.nn.functional.cosine_similarity
    assert direction(step.update[0].flatten(), expected[:, :-1].flatten(), dim=0) > 1 - 1e-5
    assert direction(step.update[1], expected[:, -1], dim=0) > 1 - 1e-5


def test_rebalancing_step_moves_the_main_head_only_by_lr_lambda_g_bal():
    method = _redgrape()
    model = method.load(method.init_state(seed=0).model)
    data = _silo([0] * 8 + [1] * 8, 2)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    step = Rebalancing(model, x, y, _known_prototypes(), lam=0.5, lr=0.2)
    torch.nn.functional.cross_entropy(two_stream(model, x), y).backward()
    step.capture()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step.apply()
    after = model.state_dict()
    assert torch.allclose(after["classifier.weight"], before["classifier.weight"] - 0.1 * step.update[0])
    assert torch.allclose(after["classifier.bias"], before["classifier.bias"] - 0.1 * step.update[1])
    assert all(torch.equal(after[k], before[k]) for k in before if not k.startswith("classifier."))


def test_balanced_set_takes_t_samples_of_every_class_with_at_least_t():
    y = torch.tensor([0] * 10 + [1] * 7 + [2] * 8)
    chosen = balanced_indices(y, 8, torch.Generator().manual_seed(0))
    assert torch.bincount(y[chosen], minlength=3).tolist() == [8, 0, 8]
    assert len(set(chosen.tolist())) == 16


def test_no_rebalancing_before_any_prototype_exists_or_with_lambda_zero():
    method = _redgrape()
    state = method.init_state(seed=0)
    model = method.load(state.model)
    x, y = torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.int64)
    assert not Rebalancing(model, x, y, state.extra, lam=0.1, lr=0.1).active
    assert not Rebalancing(model, x, y, _known_prototypes(), lam=0.0, lr=0.1).active


def test_prototypes_are_means_over_holders_and_persist_for_classes_nobody_held():
    method = _redgrape()
    state = method.init_state(seed=0)
    state = type(state)(0, state.model, _known_prototypes())
    silos = [_silo([0, 0, 1, 1, 1], 0), _silo([0, 1, 0, 0], 1)]  # classes 2, 3 held by nobody this round
    schema = method.schema(state)
    contributions = [
        method.local_round(state, d, SiloContext(1, f"silo-{k}", 0)) for k, d in enumerate(silos)
    ]
    new = method.server_step(state, PlaintextSum().aggregate(schema, contributions), ServerContext(1, 0))
    grads = [c.values["grad"].reshape(4, 4, -1) for c in contributions]
    assert torch.allclose(new.extra["prototypes"][0], ((grads[0][0] + grads[1][0]) / 2).float(), atol=1e-6)
    assert torch.equal(new.extra["prototypes"][2], state.extra["prototypes"][2])
    assert torch.equal(new.extra["prototypes"][3], state.extra["prototypes"][3])
    assert new.extra["known"].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_supplementary_head_is_trained_and_averaged_but_inference_uses_w_only():
    method = _redgrape()
    state = method.init_state(seed=0)
    assert "supplementary.weight" in state.model
    silos = [_silo([0, 0, 1, 1, 1, 2, 2, 2, 2], 0), _silo([0, 1, 0, 0, 3, 3], 1)]
    schema = method.schema(state)
    contributions = [
        method.local_round(state, d, SiloContext(1, f"silo-{k}", 0)) for k, d in enumerate(silos)
    ]
    new = method.server_step(state, PlaintextSum().aggregate(schema, contributions), ServerContext(1, 0))
    assert not torch.equal(new.model["supplementary.weight"], state.model["supplementary.weight"])
    model = method.eval_model(new)
    x = torch.from_numpy(silos[0].x)
    with torch.no_grad():
        assert torch.allclose(model(x), model.classifier(model.encoder(x)))
