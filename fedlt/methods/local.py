"""The local SGD loop every method's silo half shares.

Kept as bare as a hand-written PyTorch loop (tensors indexed by a seeded permutation, no DataLoader, no
per-step host syncs) because it is where almost all of a round's time goes; `benchmarks/sim_speed.py` holds it
to within 10% of a bare loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.config import setting


@dataclass(frozen=True)
class TrainConfig:
    local_epochs: int = setting(1, ge=1)
    batch_size: int = setting(32, ge=1)
    lr: float = setting(0.05, gt=0.0)
    momentum: float = setting(0.0, ge=0.0, le=1.0)
    weight_decay: float = setting(0.0, ge=0.0)


GradHook = Callable[[], None]
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    generator: torch.Generator,
    *,
    loss: Loss | None = None,
    before_step: GradHook | None = None,
    after_step: GradHook | None = None,
) -> None:
    """SGD over (x, y) on `loss(model, x, y)`, by default the cross-entropy of `model(x)`.

    `before_step` may edit gradients (FedProx's proximal term); `after_step` may move parameters after the
    optimizer has (RedGrape's re-balancing step)."""
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    model.train()
    n = len(y)
    for _ in range(config.local_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, config.batch_size):
            idx = order[start : start + config.batch_size]
            xb, yb = x[idx], y[idx]
            value = F.cross_entropy(model(xb), yb) if loss is None else loss(model, xb, yb)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
            if after_step is not None:
                after_step()
