"""The `[secagg]` settings a consortium (or a simulation) chooses, and the sessions they imply for a round."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.aggregation.tail_guard import GuardSettings
from fedlt.config import setting
from privacy.ring import Ring
from privacy.secagg.protocol import SessionSpec


@dataclass(frozen=True)
class SecAggSettings(GuardSettings):
    threshold: int = setting(
        0, ge=0, doc="shares needed to rebuild a seed, a majority of its holders; 0 = more than two thirds"
    )
    neighbours: int = setting(
        0, ge=0, doc="SecAgg+: each silo masks with this many peers (even); 0 = every silo (Bonawitz)"
    )

    def problems(self) -> list[str]:
        return [f"secagg.neighbours: must be even, got {self.neighbours}"] if self.neighbours % 2 else []

    def consortium_problems(self, min_silos: int, per_round: int) -> list[str]:
        """What these settings cannot do with the consortium's round sizes."""
        found = []
        if min_silos < 2:
            found.append(
                "consortium.min_silos: a secure sum needs at least 2 silos (a sum of one is its input)"
            )
        if 0 < per_round < self.threshold:
            found.append(
                f"secagg.threshold: {self.threshold} survivors can never come from {per_round} silos a round "
                "(selection.per_round)"
            )
        return found

    def describe(self) -> str:
        threshold = f"{self.threshold} shares" if self.threshold else "more than two thirds"
        graph = f"{self.neighbours} neighbours per silo (SecAgg+)" if self.neighbours else "every silo pair"
        return (
            f"secagg — the aggregator learns only sums; threshold {threshold}, masks over {graph}, "
            f"{self.describe_guard()}"
        )

    def session(
        self,
        round_id: str,
        purpose: str,
        participants: list[str] | tuple[str, ...],
        ring: Ring,
        binding: bytes,
    ) -> SessionSpec:
        return SessionSpec(
            round_id=round_id,
            purpose=purpose,
            participants=tuple(sorted(participants)),
            ring=ring,
            binding=binding,
            threshold=self.threshold,
            neighbours=self.neighbours,
        )
