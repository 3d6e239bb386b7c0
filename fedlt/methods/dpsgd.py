"""DP-SGD for `train_local` through Opacus: every record's gradient clipped, Gaussian noise on their sum, on
Poisson-sampled batches.

Clipping uses Opacus' ghost clipping (`GradSampleModuleFastGradientClipping`,
`DPOptimizerFastGradientClipping`: Li et al. 2022; Bu et al. 2023): per-record gradient norms come from the
layers' activations and output gradients without materialising per-record gradients, and a second backward
pass of the loss reweighted by each record's clipping factor gives the sum of clipped gradients — the same
sum as classic per-sample clipping, at a fraction of its cost where a large linear layer dominates (the
McMahan CNN's 1.6 M-weight dense layer).

Opacus' RDP accounting assumes each step's batch is a Poisson sample (every record in with probability
q = batch_size / n), so batches are drawn that way instead of from a shuffled order, and from the silo's
CSPRNG: a batch drawn from the run seed, which the aggregator knows, would void the amplification by
sampling. The noise comes from a CSPRNG stream too (`add_noise` is replaced: Opacus' own `secure_mode` needs
torchcsprng, which does not install here); it depends on no record, so a worker thread draws the next
step's noise while this step's gradients are computed. An epoch is ⌈n / batch_size⌉ steps, as in Opacus'
`DPDataLoader`; an empty batch is still a step (noise only), as the accounting counts it. Every trainable
parameter must be reached by the loss (ghost clipping needs each one's per-record norms): SFD freezes its
projector under DP.

A gradient edit (`before_step`: FedProx's proximal term) runs after clipping and noise, on the privatised
gradient: it reads no record, so it is post-processing and costs nothing; an edit that read records would
escape the accounting, which is why RedGrape drops its local balanced-set gradient under DP.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from torch import nn

from fedlt.methods.local import GradHook, Loss, PrivateRound, TrainConfig


class PrefetchedNoise:
    """One flat draw of noise per step for all parameters, the next one drawn ahead on a worker thread."""

    def __init__(self, draw: Callable[[int, float], torch.Tensor], count: int, std: float) -> None:
        self._draw, self._count, self._std = draw, count, std
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-noise")
        self._next: Future = self._pool.submit(draw, count, std)

    def take(self) -> torch.Tensor:
        noise = self._next.result()
        self._next = self._pool.submit(self._draw, self._count, self._std)
        return noise

    def close(self) -> None:
        self._next.cancel()
        self._pool.shutdown(wait=True)


class SecureNoiseOptimizer(DPOptimizerFastGradientClipping):
    """Opacus' optimizer for ghost clipping, with noise from the silo's CSPRNG."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise: PrefetchedNoise, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.noise = noise

    def add_noise(self) -> None:
        flat = self.noise.take()
        start = 0
        for p in self.params:
            size = p.summed_grad.numel()
            noise = flat[start : start + size].view_as(p.summed_grad).to(p.summed_grad.dtype)
            p.grad = (p.summed_grad + noise).view_as(p)
            start += size


def train_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    private: PrivateRound,
    *,
    loss: Loss,
    before_step: GradHook | None = None,
    after_step: GradHook | None = None,
) -> None:
    n = len(y)
    rate = min(config.batch_size / n, 1.0)
    steps = config.local_epochs * math.ceil(n / config.batch_size)
    sigma = private.admit_sgd(sample_rate=rate, steps=steps)
    params = [p for p in model.parameters() if p.requires_grad]
    noise = PrefetchedNoise(
        private.noise_stream(), sum(p.numel() for p in params), sigma * private.max_grad_norm
    )
    optimizer = SecureNoiseOptimizer(
        torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay),
        noise=noise,
        noise_multiplier=sigma,
        max_grad_norm=private.max_grad_norm,
        expected_batch_size=rate * n,
    )
    if before_step is not None:
        optimizer.attach_step_hook(lambda _: before_step())  # Opacus calls it after clipping and noise
    with warnings.catch_warnings():
        # torch warns that Opacus' backward hooks fire for inputs that need no gradient; harmless here
        warnings.filterwarnings("ignore", message=".*Full backward hook.*")
        wrapped = GradSampleModuleFastGradientClipping(
            model, max_grad_norm=private.max_grad_norm, use_ghost_clipping=True, loss_reduction="mean"
        )
        try:
            model.train()
            for _ in range(steps):
                idx = torch.from_numpy(private.bernoulli(n, rate).nonzero()[0])
                optimizer.zero_grad(set_to_none=True)
                if len(idx):
                    per_record = loss(model, x[idx], y[idx])
                    DPTensorFastGradientClipping(wrapped, optimizer, per_record, "mean").backward()
                else:  # an empty batch is a step too: no gradient, only noise
                    for p in params:
                        p.grad = torch.zeros_like(p)
                optimizer.step()
                if after_step is not None:
                    after_step()
        finally:
            noise.close()
            wrapped.to_standard_module()  # hooks and per-record buffers off the method's reused model
            for p in params:
                p.summed_grad = None
