"""The `[ckks]` settings a consortium (or a simulation) chooses."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.aggregation.tail_guard import GuardSettings
from fedlt.config import setting


@dataclass(frozen=True)
class CkksSettings(GuardSettings):
    key_holder: str = setting(
        "", doc="the silo that makes the consortium's CKKS key and seals it to every other silo"
    )

    def problems(self) -> list[str]:
        return []

    def consortium_problems(self, min_silos: int, per_round: int) -> list[str]:
        return [] if self.key_holder else ["ckks.key_holder: name the silo that makes the consortium's key"]

    def describe(self) -> str:
        holder = self.key_holder or "?"
        return (
            f"ckks — the aggregator adds ciphertexts and sees no sum, no model; key made by {holder}, no "
            f"threshold decryption (a silo colluding with the aggregator reads every upload); "
            f"{self.describe_guard()}"
        )


@dataclass(frozen=True)
class CkksParameters(GuardSettings):
    """What a RoundSpec signs for a CKKS round: the tail guard, and the key every silo must encrypt under."""

    context_id: str = ""
    key_holder: str = ""
