"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds (μ/2)·‖w − w_global‖².

The proximal term enters as its gradient μ(w − w_global), added to each parameter's gradient before the step —
the same update as differentiating the penalised loss, without a second pass over the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlt.config import setting
from fedlt.methods.fedavg import FedAvg, FedAvgOptions
from fedlt.methods.local import GradHook
from fedlt.models import SplitModel


@dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    mu: float = setting(0.01, ge=0.0, doc="proximal weight μ")


class FedProx(FedAvg):
    name = "fedprox"
    Options = FedProxOptions

    def before_step(self, model: SplitModel) -> GradHook | None:
        mu = self.options.mu
        params = [p for p in model.parameters() if p.requires_grad]
        anchors = [p.detach().clone() for p in params]

        def proximal() -> None:
            with torch.no_grad():
                for p, anchor in zip(params, anchors, strict=True):
                    if p.grad is not None:
                        p.grad.add_(p - anchor, alpha=mu)

        return proximal
