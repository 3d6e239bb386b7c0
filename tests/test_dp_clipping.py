"""Book-keeping clipping (`fedlt.methods.clipping`) against per-record gradients taken one at a time."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlt.methods import ModelSpec
from fedlt.methods.clipping import PerRecordClipping
from fedlt.methods.dpsgd import privatise
from fedlt.methods.redgrape import two_stream_loss


def _per_record_clipped_sum(
    model: nn.Module, loss, x, y, clip: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The definition: each record's gradient on its own, scaled by min(1, C / ‖g_i‖), summed."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(len(y)):
        grads = torch.autograd.grad(loss(model, x[i : i + 1], y[i : i + 1]).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        norms.append(norm)
        factor = min(1.0, clip / (norm.item() + 1e-6))
        for t, g in zip(total, grads, strict=True):
            t += factor * g
    return total, torch.stack(norms)


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def _with_head(spec: ModelSpec) -> nn.Module:
    model = spec.build(0)
    model.supplementary = nn.Linear(model.feature_dim, model.num_classes)  # RedGrape's second head
    return model


CASES = {
    "cnn": (lambda: ModelSpec("cnn", (1, 28, 28), 10, private=True).build(0), _ce, (1, 28, 28)),
    "resnet8-groupnorm": (
        lambda: ModelSpec("resnet8", (3, 32, 32), 10, private=True).build(0),
        _ce,
        (3, 32, 32),
    ),
    "two-heads": (
        lambda: _with_head(ModelSpec("cnn-small", (1, 8, 8), 10, private=True)),
        two_stream_loss,
        (1, 8, 8),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clipped_sum_is_the_per_record_definition(case):
    """Guards the one-pass clipping for every layer kind a private model has (convolutions, GroupNorm, dense
    layers, two heads on one encoder): the sum equals clipping each record's own gradient, with the clip
    norm between the records' norms so that some are clipped and some are not."""
    build, loss, shape = CASES[case]
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, *shape, generator=gen)
    x[2] *= 30.0  # one record far out, so its gradient is far larger
    y = torch.randint(0, 10, (6,), generator=gen)
    model = build()
    _, norms = _per_record_clipped_sum(model, loss, x, y, clip=1e9)
    clip = norms.median().item()
    assert (norms > clip).any()
    assert (norms < clip).any()
    expected, _ = _per_record_clipped_sum(model, loss, x, y, clip)

    clipping = PerRecordClipping(model, clip)
    try:
        clipping.start()
        clipping.backward(loss(model, x, y))
    finally:
        clipping.remove()
    got = [p.grad for p in model.parameters() if p.requires_grad]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_an_unreached_parameter_gets_noise_only():
    """Guards the noise on every trainable parameter: a head the loss never uses has no gradient from the
    records, yet DP-SGD's privatised gradient still carries its slice of the noise."""
    model = _with_head(ModelSpec("cnn-small", (1, 8, 8), 10, private=True))
    clipping = PerRecordClipping(model, 1.0)
    x, y = torch.rand(4, 1, 8, 8), torch.randint(0, 10, (4,))
    clipping.start()
    clipping.backward(_ce(model, x, y))  # the plain head only: `supplementary` is not reached
    clipping.remove()
    params = [p for p in model.parameters() if p.requires_grad]
    assert model.supplementary.weight.grad is None
    noise = torch.arange(sum(p.numel() for p in params), dtype=torch.float32)
    privatise(params, noise.clone(), 2.0)
    weight = model.supplementary.weight
    start = sum(p.numel() for p in params[:-2])
    torch.testing.assert_close(weight.grad.flatten(), noise[start : start + weight.numel()] / 2.0)


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(x))


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.layer(x), inplace=True)


def test_refuses_what_it_cannot_clip_exactly():
    """Guards the limits with clear errors rather than a wrong sum: a layer type without a per-sample rule
    (BatchNorm mixes a batch's records), a layer run twice in one step, an output edited in place."""
    with pytest.raises(ValueError, match="BatchNorm1d"):
        PerRecordClipping(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), 1.0)
    x = torch.rand(3, 4)
    shared_model = _Shared()
    PerRecordClipping(shared_model, 1.0).start()
    with pytest.raises(ValueError, match="ran twice"):
        shared_model(x)
    inplace_model = _InPlace()
    inplace = PerRecordClipping(inplace_model, 1.0)
    inplace.start()
    with pytest.raises(ValueError, match="in place"):
        inplace.backward(inplace_model(x).sum(dim=1))


def test_forward_without_gradients_keeps_nothing():
    """Guards evaluation inside training (e.g. under `torch.no_grad`): it holds no record's activations."""
    model = ModelSpec("cnn-small", (1, 8, 8), 10, private=True).build(0)
    clipping = PerRecordClipping(model, 1.0)
    with torch.no_grad():
        model(torch.rand(2, 1, 8, 8))
    assert not clipping._seen
    clipping.remove()
