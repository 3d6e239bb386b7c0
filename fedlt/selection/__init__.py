"""Picking a round's silos, including DFL-FS's masked feature-statistics clustering (MFSC)."""

from fedlt.selection.choose import SelectionBook, choose_participants, tail_first
from fedlt.selection.config import MASKS, STRATEGIES, SelectionConfig
from fedlt.selection.mfsc import (
    DISCLOSURE,
    class_mean_disclosure,
    estimate_coverage,
    mask_generator,
    masked_class_means,
    simulated_mask_secret,
)

__all__ = [
    "DISCLOSURE",
    "MASKS",
    "STRATEGIES",
    "SelectionBook",
    "SelectionConfig",
    "choose_participants",
    "class_mean_disclosure",
    "estimate_coverage",
    "mask_generator",
    "masked_class_means",
    "simulated_mask_secret",
    "tail_first",
]
