"""The `[ckks]` settings a consortium (or a simulation) chooses."""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.config import setting


@dataclass(frozen=True)
class CkksSettings:
    key_holder: str = setting(
        "", doc="the silo that makes the consortium's CKKS key and seals it to every other silo"
    )
    k_min: int = setting(2, ge=0, doc="tail guard: zero per-class fields of classes fewer silos hold; <2 off")

    def problems(self) -> list[str]:
        return []

    def consortium_problems(self, min_silos: int, per_round: int) -> list[str]:
        return [] if self.key_holder else ["ckks.key_holder: name the silo that makes the consortium's key"]

    def describe(self) -> str:
        guard = f"tail guard k_min {self.k_min}" if self.k_min >= 2 else "tail guard off"
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
