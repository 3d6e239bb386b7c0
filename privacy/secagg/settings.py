"""The `[secagg]` settings a consortium (or a simulation) chooses, and the sessions they imply for a round."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.aggregation.tail_guard import ONLY_UNDER_DP
from fedlt.config import setting
from privacy.secagg.protocol import SessionSpec
from privacy.secagg.ring import Ring


@dataclass(frozen=True)
class SecAggSettings:
    threshold: int = setting(
        0, ge=0, doc="shares needed to rebuild a seed, a majority of its holders; 0 = more than two thirds"
    )
    neighbours: int = setting(
        0, ge=0, doc="SecAgg+: each silo masks with this many peers (even); 0 = every silo (Bonawitz)"
    )
    k_min: int = setting(2, ge=0, doc="tail guard: zero per-class fields of classes fewer silos hold; <2 off")
    min_records: int = setting(
        ONLY_UNDER_DP,
        ge=0,
        doc="per-class statistics that invert (second moments, per-class gradients) leave silos without [dp] "
        "only for classes this many records hold; 0: never without [dp] (they invert at any class size)",
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
        floor = (
            f"record floor {self.min_records}" if self.min_records else "statistics that invert only under DP"
        )
        guard = f"tail guard k_min {self.k_min}, {floor}" if self.k_min >= 2 else "tail guard off"
        return f"secagg — the aggregator learns only sums; threshold {threshold}, masks over {graph}, {guard}"

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
