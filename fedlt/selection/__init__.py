"""Picking a round's silos, including DFL-FS's masked feature-statistics clustering (MFSC)."""

from fedlt.selection.choose import SelectionBook, choose_participants, tail_first
from fedlt.selection.config import MASKS, STRATEGIES, SelectionConfig
from fedlt.selection.mfsc import (
    DISCLOSURE,
    MaskStream,
    class_mean_disclosure,
    estimate_coverage,
    mask_stream,
    masked_class_means,
    simulated_mask_secret,
)

__all__ = [
    "DISCLOSURE",
    "MASKS",
    "STRATEGIES",
    "MaskStream",
    "SelectionBook",
    "SelectionConfig",
    "choose_participants",
    "class_mean_disclosure",
    "estimate_coverage",
    "mask_stream",
    "masked_class_means",
    "simulated_mask_secret",
    "tail_first",
]
