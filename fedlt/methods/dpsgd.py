"""DP-SGD for `train_local`: every record's gradient clipped, Gaussian noise on their sum, on Poisson-sampled
batches, as Opacus' `DPOptimizer` does it (noise std σ·C on the clipped sum, divided by the expected batch
size).

Clipping is book-keeping clipping (`fedlt.methods.clipping`): one backward pass and no materialised
per-record gradient for dense layers, where Opacus' ghost clipping needs two backward passes; the per-layer
per-sample rules are Opacus' own. The sum it gives is the one classic per-sample clipping gives.

Opacus' RDP accounting assumes each step's batch is a Poisson sample (every record in with probability
q = batch_size / n), so batches are drawn that way instead of from a shuffled order, and from the silo's
CSPRNG: a batch drawn from the run seed, which the aggregator knows, would void the amplification by
sampling. The noise comes from a CSPRNG stream too (Opacus' own `secure_mode` needs torchcsprng, which does
not install here); it depends on no record, so a worker thread draws the next step's noise while this
step's gradients are computed. An epoch is ⌈n / batch_size⌉ steps, as in Opacus' `DPDataLoader`; an empty
batch is still a step (noise only), as the accounting counts it. A trainable parameter the loss does not
reach gets noise only.

`after_clipping` runs between the clipped sum and the noise, where each record's gradient has entered: the
privacy audit's canaries (`attacks.epsilon`) enter there, so that they take the records' own path through the
noise and the division. A gradient edit (`before_step`: FedProx's proximal term) runs after clipping and
noise, on the privatised gradient: it reads no record, so it is post-processing and costs nothing; an edit
that read records would escape the accounting, which is why RedGrape drops its local balanced-set gradient
under DP.

On a GPU the batches and the noise move to the model; both are still drawn on the CPU, from the CSPRNG.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from fedlt.device import model_device
from fedlt.methods.clipping import PerRecordClipping
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


def privatise(params: list[nn.Parameter], noise: torch.Tensor, expected_batch_size: float) -> None:
    """Each `.grad` (the clipped sum, or none) becomes (sum + its slice of `noise`) / expected batch size;
    `noise` is used up (its slices may become gradients)."""
    start = 0
    for p in params:
        share = noise[start : start + p.numel()].view_as(p)
        p.grad = (share if p.grad is None else p.grad.add_(share)).div_(expected_batch_size)
        start += p.numel()


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
    after_clipping: GradHook | None = None,
) -> None:
    n = len(y)
    rate = min(config.batch_size / n, 1.0)
    steps = config.epochs(n) * config.steps_per_epoch(n)
    sigma = private.admit_sgd(sample_rate=rate, steps=steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    clipping = PerRecordClipping(model, private.max_grad_norm)
    noise = PrefetchedNoise(
        private.noise_stream(), sum(p.numel() for p in params), sigma * private.max_grad_norm
    )
    device = model_device(model)
    try:
        model.train()
        for _ in range(steps):
            idx = torch.from_numpy(private.bernoulli(n, rate).nonzero()[0])
            optimizer.zero_grad(set_to_none=True)
            if len(idx):  # an empty batch is a step too: no gradient, only noise
                clipping.start()
                clipping.backward(loss(model, x[idx].to(device), y[idx].to(device)))
            if after_clipping is not None:
                after_clipping()
            privatise(params, noise.take().to(device), rate * n)
            if before_step is not None:
                before_step()
            optimizer.step()
            if after_step is not None:
                after_step()
    finally:
        noise.close()
        clipping.remove()  # no hooks or kept inputs left on the method's reused model
