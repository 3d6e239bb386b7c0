"""The linear head's side of the long-tail methods: features, closed-form head gradients, head re-training.

CReFF, RedGrape and CCVR all work on the classifier h(z) = Wz + b over features z from a frozen encoder.
For cross-entropy its gradient has a closed form, ∂ℓ/∂[W | b] = (softmax(Wz + b) − e_y)·[zᵀ | 1], which is
exact, cheap, differentiable in z (CReFF's feature matching needs that) and free of autograd's per-step
overhead in the thousands of small re-training steps a round runs. A head gradient is kept as one (C, d + 1)
matrix [∇W | ∇b].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.aggregation import Field
from fedlt.data.arrays import LabeledData
from fedlt.device import CPU, model_device, placed
from fedlt.dp import DPSettings
from fedlt.models import SplitModel

FEATURE_BATCH = 256


def extract_features(model: SplitModel, x: torch.Tensor) -> torch.Tensor:
    """Encoder outputs in eval mode (BatchNorm running statistics), without gradients; each batch of `x`
    moves to the model, and the features stay there."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    with torch.no_grad():
        z = torch.cat(
            [model.encoder(x[i : i + FEATURE_BATCH].to(device)) for i in range(0, len(x), FEATURE_BATCH)]
        )
    model.train(was_training)
    return z


def head_of(weights: dict[str, torch.Tensor] | nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, b) of a model's classifier, as detached float32 tensors."""
    state = weights.state_dict() if isinstance(weights, nn.Module) else weights
    return state["classifier.weight"].detach().float(), state["classifier.bias"].detach().float()


def with_head(weights: dict[str, torch.Tensor], weight: torch.Tensor, bias: torch.Tensor) -> dict:
    """A model state whose classifier is replaced by (weight, bias): backbone of one, head of another."""
    return {**weights, "classifier.weight": weight.float(), "classifier.bias": bias.float()}


def logit_residuals(
    weight: torch.Tensor, bias: torch.Tensor, z: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """softmax(Wz + b) − e_y per sample: the cross-entropy gradient with respect to the logits."""
    residual = torch.softmax(z @ weight.T + bias, dim=-1)
    return residual - F.one_hot(y, weight.shape[0]).to(residual.dtype)


def head_gradient(weight: torch.Tensor, bias: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[∇W | ∇b] of the mean cross-entropy over (z, y), shape (C, d + 1)."""
    residual = logit_residuals(weight, bias, z, y) / len(y)
    return torch.cat([residual.T @ z, residual.sum(0)[:, None]], dim=1)


def class_head_gradients(
    weight: torch.Tensor, bias: torch.Tensor, z: torch.Tensor, y: torch.Tensor, *, mean: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class c, the head gradient averaged over the samples of class c (CReFF's Eq. 3, RedGrape's Eq. 11).

    Returns (present, grads): present[c] = 1 where the class has samples, grads (C, C, d + 1) with zeros
    elsewhere — the two fields whose sums give the mean over the silos holding each class. With
    `mean=False`, grads are sums over the class's samples (under DP: a sum has a per-record sensitivity).
    """
    classes = weight.shape[0]
    z64, residual = z.double(), logit_residuals(weight.double(), bias.double(), z.double(), y)
    counts = torch.bincount(y, minlength=classes).double()
    members = F.one_hot(y, classes).double()  # (N, C)
    if mean:
        members = members / counts.clamp(min=1)  # 1/n_c for the sample's class
    grad_w = torch.einsum("nc,nj,nk->cjk", members, residual, z64)
    grad_b = members.T @ residual
    return (counts > 0).double(), torch.cat([grad_w, grad_b[:, :, None]], dim=2)


def class_gradient_fields(
    classes: int, dim: int, bound: float, what: str, *, dp: DPSettings | None = None, n_max: float = 1.0
) -> tuple[Field, Field]:
    """`grad` (per class held, the head's [∇W | ∇b] flattened) and `present`, per class for the tail guard.

    Under DP (`dp`) `grad` is the sum over the class's records, whose features are clipped to
    `dp.feature_norm` (which bounds one record's gradient, `head_gradient_sensitivity`), and `present` the
    silo's noised record count of the class, so that summed gradients over summed counts give the pooled
    mean: a per-silo mean has no bounded sensitivity."""
    summed = dp is not None
    return (
        Field(
            "grad",
            (classes, classes * (dim + 1)),
            n_max * bound if summed else bound,
            f"per class: Σ over records of [∇W | ∇b] of {what}"
            if summed
            else f"per class held: [∇W | ∇b] of {what}",
            per_class=True,
            sensitivity=head_gradient_sensitivity(dp.feature_norm) if summed else 0.0,
            inverts=True,  # one record's row is its feature (attacks.analytic)
        ),
        Field(
            "present",
            (classes,),
            n_max if summed else 1.0,
            "per class, the noised record count" if summed else "1 for each class the silo holds",
            frac_bits=0,
            per_class=True,
        ),
    )


def head_gradient_sensitivity(feature_norm: float) -> float:
    """The largest L2 norm of one record's [∇W | ∇b] = (p − e_y)·[zᵀ | 1] when ‖z‖ ≤ feature_norm:
    ‖p − e_y‖ ≤ √2 and ‖[z | 1]‖ ≤ √(feature_norm² + 1)."""
    return math.sqrt(2.0 * (feature_norm**2 + 1.0))


def clip_features(z: torch.Tensor, norm: float) -> torch.Tensor:
    """Each feature vector scaled down to L2 norm at most `norm` (per-record clipping under DP)."""
    scale = (norm / z.norm(dim=1, keepdim=True).clamp(min=1e-12)).clamp(max=1.0)
    return z * scale


def class_gradient_values(
    model: SplitModel,
    data: LabeledData,
    *,
    device: torch.device = CPU,
    dp: DPSettings | None = None,
    counts: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The values of `class_gradient_fields` for `model`'s head over the silo's features, computed on
    `device` and returned on the CPU; under DP with `counts`, the silo's reported (noised) class counts."""
    with placed(model, device):
        z = extract_features(model, torch.from_numpy(data.x))
        y = torch.from_numpy(data.y).to(device)
        if dp is None:
            present, grads = class_head_gradients(*head_of(model), z, y)
            return {"grad": grads.flatten(1).cpu(), "present": present.cpu()}
        z = clip_features(z, dp.feature_norm)
        _, grads = class_head_gradients(*head_of(model), z, y, mean=False)
        return {"grad": grads.flatten(1).cpu(), "present": counts}


def mean_over_holders(summed: torch.Tensor, holders: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class's sum divided by how many silos held it; returns (held, means) with held[c] = holders > 0.

    Holders are counted exactly (integers, even after fixed-point decoding), so rounding is safe.
    """
    counts = holders.round()
    held = counts > 0
    means = torch.zeros_like(summed)
    means[held] = summed[held] / counts[held].reshape(-1, *([1] * (summed.dim() - 1)))
    return held, means


def retrain_head(
    z: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    cosine: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mini-batch SGD on cross-entropy of the head alone, as torch.optim.SGD would step it.

    Each epoch visits (z, y) in a fresh seeded order; `cosine` anneals the rate per epoch as
    lr·½(1 + cos(πe/E)).
    Returns new tensors; the inputs are not modified.
    """
    params = torch.cat([weight, bias[:, None]], dim=1).clone()
    velocity = torch.zeros_like(params)
    n = len(y)
    for epoch in range(epochs):
        rate = lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs)) if cosine else lr
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            grad = head_gradient(params[:, :-1], params[:, -1], z[idx], y[idx])
            if weight_decay:
                grad += weight_decay * params
            if momentum:
                velocity.mul_(momentum).add_(grad)
                grad = velocity
            params -= rate * grad
    return params[:, :-1].contiguous(), params[:, -1].contiguous()


def fresh_head(features: int, classes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's default nn.Linear initialisation, U(−1/√d, 1/√d) for W and b, drawn from `generator`."""
    bound = 1.0 / math.sqrt(features)
    weight = (torch.rand(classes, features, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(classes, generator=generator) * 2 - 1) * bound
    return weight, bias
