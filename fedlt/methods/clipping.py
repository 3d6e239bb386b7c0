"""The sum of per-record clipped gradients in one backward pass: book-keeping clipping (Bu et al. 2023,
"Differentially private optimization on large model at small cost").

Opacus' ghost clipping (`GradSampleModuleFastGradientClipping`) runs two backward passes a step: one whose
hooks compute each record's gradient norm, a second of the loss reweighted by the clipping factors, which
recomputes every layer's input gradients and weight gradients to form the clipped sum. Book-keeping needs
one pass and no weight gradients from autograd at all: forward hooks keep each layer's input a, one
`autograd.grad` to the layers' outputs gives every record's output gradient g (autograd skips the weight
gradients nobody asked for), and the clipped sum of each layer follows from (a, g) and the factors c:
- a linear layer on one vector per record never materialises per-record gradients: its norms are
  ‖a_i‖·‖g_i‖ (the ghost norm) and its clipped sum one matrix product, (c ⊙ g)ᵀ a;
- every other layer (convolutions, GroupNorm, ...) uses Opacus' own per-layer per-sample gradient rules
  (`GradSampleModule.GRAD_SAMPLERS`), whose c-weighted sum is the clipped sum.

The result is the same sum Opacus' ghost and classic clipping give (tests compare it with per-record
gradients from `torch.func`). A module must run once per step (no weight sharing): a second call would need
cross terms in its norm, and is refused.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import GradSampleModule
from torch import nn

_EPS = 1e-6  # Opacus' guard in its clipping factor C / (‖g‖ + 1e-6)


class PerRecordClipping:
    """Hooks on every module that owns trainable parameters; `backward` sets each parameter's `.grad` to
    Σ_i min(1, C / ‖∇ℓ_i‖) ∇ℓ_i over the records of the batch. `remove()` takes the hooks off."""

    def __init__(self, model: nn.Module, max_grad_norm: float) -> None:
        self.max_grad_norm = max_grad_norm
        self.layers = [
            m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        for layer in self.layers:
            if not _ghost(layer) and type(layer) not in GradSampleModule.GRAD_SAMPLERS:
                raise ValueError(f"DP-SGD cannot clip per record through a {type(layer).__name__} layer")
        self._seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._handles = [layer.register_forward_hook(self._keep) for layer in self.layers]

    def _keep(self, layer: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            return
        if layer in self._seen:
            raise ValueError(f"a {type(layer).__name__} layer ran twice in one DP-SGD step (weight sharing)")
        self._seen[layer] = (inputs[0].detach(), output, output._version)

    def start(self) -> None:
        """Forget the inputs of an earlier forward pass; call before each step's loss."""
        self._seen.clear()

    def backward(self, per_record: torch.Tensor) -> None:
        seen, self._seen = self._seen, {}
        layers = [layer for layer, (_, output, _) in seen.items() if output.requires_grad]
        for layer in layers:
            if seen[layer][1]._version != seen[layer][2]:  # its gradient would be the edited tensor's
                raise ValueError(
                    f"a {type(layer).__name__} layer's output was modified in place (inplace=True)"
                )
        backprops = torch.autograd.grad(
            per_record.sum(), [seen[layer][1] for layer in layers], allow_unused=True
        )
        squared = torch.zeros(len(per_record), device=per_record.device)
        parts = []
        for layer, g in zip(layers, backprops, strict=True):
            if g is None:  # the output does not reach the loss: no record moves this layer
                continue
            a = seen[layer][0]
            if _ghost(layer) and g.dim() == 2:
                g2 = g.square().sum(dim=1)
                if layer.weight.requires_grad:
                    squared += g2 * a.square().sum(dim=1)
                if layer.bias is not None and layer.bias.requires_grad:
                    squared += g2
                parts.append((layer, a, g, None))
            else:
                samples = GradSampleModule.GRAD_SAMPLERS[type(layer)](layer, [a], g)
                for sample in samples.values():
                    squared += sample.flatten(start_dim=1).square().sum(dim=1)
                parts.append((layer, a, g, samples))
        factors = (self.max_grad_norm / (squared.sqrt() + _EPS)).clamp(max=1.0)
        for layer, a, g, samples in parts:
            if samples is None:
                weighted = g * factors[:, None]
                if layer.weight.requires_grad:
                    _accumulate(layer.weight, weighted.T @ a)
                if layer.bias is not None and layer.bias.requires_grad:
                    _accumulate(layer.bias, weighted.sum(dim=0))
            else:
                for param, sample in samples.items():
                    _accumulate(param, torch.einsum("n,n...->...", factors, sample))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._seen.clear()


def _ghost(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad
