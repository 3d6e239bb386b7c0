"""The local SGD loop every method's silo half shares.

Kept as bare as a hand-written PyTorch loop (tensors indexed by a seeded permutation, no DataLoader, no
per-step host syncs) because it is where almost all of a round's time goes; `benchmarks/sim_speed.py` holds it
to within 10% of a bare loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedlt.config import parse_section, setting
from fedlt.device import DEVICE_FORM, device_checked, model_device


@dataclass(frozen=True)
class TrainConfig:
    """`device` is where this party trains and evaluates (`fedlt.device`): its own choice, so a plan's text
    leaves it out (`to_table`)."""

    local_epochs: int = setting(1, ge=1)
    batch_size: int = setting(32, ge=1)
    lr: float = setting(0.05, gt=0.0)
    momentum: float = setting(0.0, ge=0.0, le=1.0)
    weight_decay: float = setting(0.0, ge=0.0)
    min_steps: int = setting(0, ge=0, doc="a silo trains more epochs until it has taken this many steps")
    device: str = setting(
        "auto",
        doc=f"{DEVICE_FORM}: where this party trains and evaluates; auto is a GPU where torch sees one. "
        "Never part of a plan: a silo sets it in silo.toml's [compute]",
    )

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str, problems: list[str]) -> TrainConfig:
        """The settings, with `device` checked for its form only: what hardware there is is asked where the
        device is used (`fedlt.device.resolve_device`), so a plan reads the same on every machine."""
        return parse_section(cls, device_checked(table, where, problems), where, problems)

    def to_table(self) -> dict[str, Any]:
        """Without `device`, each party's own: a plan's text and hash, and a simulator run's fingerprint (a
        run may resume on another device), are what they were before the setting existed."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "device"}

    def epochs(self, samples: int) -> int:
        """`local_epochs`, or more where a silo is so small that they would take fewer than `min_steps`."""
        return max(self.local_epochs, math.ceil(self.min_steps / self.steps_per_epoch(samples)))

    def steps_per_epoch(self, samples: int) -> int:
        return max(1, math.ceil(samples / self.batch_size))


GradHook = Callable[[], None]
# per-record losses, shape (N,): plain training takes their mean; DP-SGD needs them apart to clip each record
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


class PrivateRound(Protocol):
    """What DP-SGD needs from a silo's privacy side (`privacy.dp.SiloPrivacy`): noise and Poisson sampling
    from a CSPRNG, and a budget ledger that admits the round's steps before any of them is taken."""

    max_grad_norm: float

    def admit_sgd(self, *, sample_rate: float, steps: int) -> float:
        """Record `steps` of DP-SGD at `sample_rate` in the ledger (or refuse); the noise multiplier σ."""
        ...

    def reported_counts(self, counts: np.ndarray) -> np.ndarray:
        """The silo's per-class record counts noised once per data set and reused (a count is released by
        nearly every method, and each fresh noisy copy would cost budget again)."""
        ...

    def noise_stream(self) -> Callable[[int, float], torch.Tensor]:
        """A draw of `count` N(0, std²) float32 values, from a stream of its own (it may run on a worker
        thread while the main one samples batches)."""
        ...

    def bernoulli(self, count: int, p: float) -> np.ndarray: ...


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
    private: PrivateRound | None = None,
) -> None:
    """SGD over (x, y) on the mean of `loss(model, x, y)`, by default the cross-entropy of `model(x)`; DP-SGD
    when `private` is given (`fedlt.methods.dpsgd`).

    `before_step` may edit gradients (FedProx's proximal term); `after_step` may move parameters after the
    optimizer has (RedGrape's re-balancing step). Under DP-SGD both see only privatised gradients.

    The model may be on a GPU (`fedlt.device.placed`); (x, y) stay where they are, on the CPU, and each
    batch moves to the model: the seeded order is drawn on the CPU, so a GPU run visits the same batches."""
    if private is not None:
        from fedlt.methods.dpsgd import train_private  # Opacus loads only for private training

        loss = loss or cross_entropy
        train_private(model, x, y, config, private, loss=loss, before_step=before_step, after_step=after_step)
        return
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    model.train()
    device = model_device(model)
    n = len(y)
    for _ in range(config.epochs(n)):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, config.batch_size):
            idx = order[start : start + config.batch_size]
            xb, yb = x[idx].to(device), y[idx].to(device)
            value = F.cross_entropy(model(xb), yb) if loss is None else loss(model, xb, yb).mean()
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
            if after_step is not None:
                after_step()
