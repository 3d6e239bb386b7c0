"""`[selection]`: which silos train in a round: every silo, a seeded random sample, or MFSC's pick."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.config import setting

STRATEGIES = ("random", "mfsc")
MASKS = ("gaussian", "uniform")


@dataclass(frozen=True)
class SelectionConfig:
    per_round: int = setting(0, ge=0, doc="silos that train in a round; 0 means every silo, every round")
    strategy: str = setting(
        "random",
        choices=STRATEGIES,
        doc="mfsc asks every connected silo for its masked class means: a per-silo disclosure",
    )
    mask: str = setting("gaussian", choices=MASKS, doc="what mfsc puts in place of the classes a silo lacks")
    separation: float = setting(
        2.0, gt=1.0, doc="mfsc: how many times apart the two modes of neighbour distances must be"
    )
    min_samples: int = setting(
        5, ge=1, doc="mfsc: a class a silo holds fewer samples of is disclosed as a mask, never as its mean"
    )

    @property
    def discloses(self) -> bool:
        return self.per_round > 0 and self.strategy == "mfsc"

    def problems(self, section: str = "selection") -> list[str]:
        if self.strategy == "mfsc" and self.per_round == 0:
            return [f"{section}.strategy: mfsc picks silos, so {section}.per_round must be at least 1"]
        return []
