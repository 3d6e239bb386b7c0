"""The `[secagg]` settings a consortium (or a simulation) chooses, and the sessions they imply for a round."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.config import setting
from privacy.secagg.protocol import SessionSpec


@dataclass(frozen=True)
class SecAggSettings:
    threshold: int = setting(
        0, ge=0, doc="shares needed to rebuild a seed, a majority of its holders; 0 = more than two thirds"
    )
    neighbours: int = setting(
        0, ge=0, doc="SecAgg+: each silo masks with this many peers (even); 0 = every silo (Bonawitz)"
    )
    k_min: int = setting(2, ge=0, doc="tail guard: zero per-class fields of classes fewer silos hold; <2 off")

    def problems(self) -> list[str]:
        return [f"secagg.neighbours: must be even, got {self.neighbours}"] if self.neighbours % 2 else []

    def session(
        self,
        round_id: str,
        purpose: str,
        participants: list[str] | tuple[str, ...],
        words: int,
        binding: bytes,
    ) -> SessionSpec:
        return SessionSpec(
            round_id=round_id,
            purpose=purpose,
            participants=tuple(sorted(participants)),
            words=words,
            binding=binding,
            threshold=self.threshold,
            neighbours=self.neighbours,
        )
