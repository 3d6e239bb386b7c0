"""Accuracy overall, per class, and by shot group (many/medium/few by training-set class size).

Shot groups follow the common long-tail convention (Liu et al., CVPR 2019): many > 100, few < 20 training
samples, medium in between; the thresholds are settings and every report states the ones it used. A group
with no class in it has no accuracy: it is reported as None (JSON null), never as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.device import CPU, placed

GROUPS = ("many", "medium", "few")


@dataclass(frozen=True)
class ShotThresholds:
    many: int = setting(100, ge=0, doc="a class with more training samples than this is many-shot")
    few: int = setting(20, ge=0, doc="a class with fewer training samples than this is few-shot")

    def groups(self, train_counts: np.ndarray) -> dict[str, list[int]]:
        many = [c for c, n in enumerate(train_counts) if n > self.many]
        few = [c for c, n in enumerate(train_counts) if n < self.few]
        medium = [c for c in range(len(train_counts)) if c not in many and c not in few]
        return {"many": many, "medium": medium, "few": few}

    def rules(self) -> dict[str, str]:
        return {
            "many": f"> {self.many} training samples",
            "medium": f"{self.few}..{self.many} training samples",
            "few": f"< {self.few} training samples",
        }


@torch.no_grad()
def predict(
    model: nn.Module, x: np.ndarray, batch_size: int = 128, *, device: torch.device = CPU
) -> np.ndarray:
    """The predicted classes, computed with `model` on `device` (and back on the CPU after).

    Batches small enough that the allocator reuses their activations: at 1024 images the McMahan CNN's
    ~100 MB of activations went back to the kernel after each call and page-faulted in again (128,000 faults
    for 1,000 images; none at 128, and a quarter less time)."""
    model.eval()
    images = torch.from_numpy(x)
    with placed(model, device):
        predicted = [
            model(images[i : i + batch_size].to(device)).argmax(1).cpu().numpy()
            for i in range(0, len(images), batch_size)
        ]
    return np.concatenate(predicted)


def accuracy_report(
    y_true: np.ndarray, y_pred: np.ndarray, groups: dict[str, list[int]], num_classes: int
) -> dict[str, object]:
    correct = np.bincount(y_true[y_true == y_pred], minlength=num_classes)
    return accuracy_from_counts(correct, np.bincount(y_true, minlength=num_classes), groups)


def accuracy_from_counts(
    correct: Sequence[int], total: Sequence[int], groups: dict[str, list[int]]
) -> dict[str, object]:
    """The report from per-class counts: all that silos disclose where only they hold the model (ckks)."""
    correct, total = np.asarray(correct, dtype=np.int64), np.asarray(total, dtype=np.int64)

    def ratio(classes: Sequence[int]) -> float | None:
        seen = int(total[list(classes)].sum())
        return int(correct[list(classes)].sum()) / seen if seen else None

    report: dict[str, object] = {"accuracy": ratio(range(len(total)))}
    for name in GROUPS:
        report[name] = ratio(groups[name]) if groups[name] else None
    report["per_class"] = [ratio([c]) for c in range(len(total))]
    return report


def evaluate(
    model: nn.Module, test: LabeledData, groups: dict[str, list[int]], *, device: torch.device = CPU
) -> dict[str, object]:
    return accuracy_report(test.y, predict(model, test.x, device=device), groups, test.num_classes)
