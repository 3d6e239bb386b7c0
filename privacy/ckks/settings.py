"""The `[ckks]` settings a consortium (or a simulation) chooses."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.aggregation.tail_guard import ONLY_UNDER_DP
from fedlt.config import setting


@dataclass(frozen=True)
class CkksSettings:
    key_holder: str = setting(
        "", doc="the silo that makes the consortium's CKKS key and seals it to every other silo"
    )
    k_min: int = setting(2, ge=0, doc="tail guard: zero per-class fields of classes fewer silos hold; <2 off")
    min_records: int = setting(
        ONLY_UNDER_DP,
        ge=0,
        doc="per-class statistics that invert (second moments, per-class gradients) leave silos without [dp] "
        "only for classes this many records hold; 0: never without [dp] (they invert at any class size)",
    )

    def problems(self) -> list[str]:
        return []

    def consortium_problems(self, min_silos: int, per_round: int) -> list[str]:
        return [] if self.key_holder else ["ckks.key_holder: name the silo that makes the consortium's key"]

    def describe(self) -> str:
        floor = (
            f"record floor {self.min_records}" if self.min_records else "statistics that invert only under DP"
        )
        guard = f"tail guard k_min {self.k_min}, {floor}" if self.k_min >= 2 else "tail guard off"
        holder = self.key_holder or "?"
        return (
            f"ckks — the aggregator adds ciphertexts and sees no sum, no model; key made by {holder}, no "
            f"threshold decryption (a silo colluding with the aggregator reads every upload); {guard}"
        )


@dataclass(frozen=True)
class CkksParameters:
    """What a RoundSpec signs for a CKKS round: the tail guard, and the key every silo must encrypt under."""

    k_min: int
    context_id: str
    key_holder: str
    min_records: int = ONLY_UNDER_DP
