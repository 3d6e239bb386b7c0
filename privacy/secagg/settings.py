"""The session the aggregator proposes and what a silo accepts: the `[secagg]` settings a consortium (or a
simulation) chooses, the sessions they imply for a round, and a silo's minimums for every secure sum it joins
(`SessionPolicy`). The aggregator proposes the session, the silo disposes.

Against a malicious aggregator the threshold is what stands between a silo and a split view: the aggregator
tells one group of silos that the victim dropped out (they reveal its mask key) and another that it survived
(they reveal its self mask). Each group must collect t consistency signatures, and colluding silos sign for
both, so with n holders and c colluders the attack needs (n - c) + 2c ≥ 2t, that is c ≥ 2t − n. A threshold
above 2n/3 therefore forces the aggregator to corrupt more than n/3 silos; a bare majority would need one.
The defaults refuse anything weaker, sums over fewer than three silos (with two, the other silo's input is the
sum minus one's own), and sparse SecAgg+ graphs, whose neighbourhoods an aggregator colluding with a silo
could steer (see `protocol`). The floor on consistency signatures is the threshold itself: a silo reveals
shares only after t signatures on its own view (`SecAggClient.unmask`), so the threshold floor is that too.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from fedlt.aggregation.tail_guard import GuardSettings
from fedlt.config import setting
from privacy.ring import Ring
from privacy.secagg.protocol import SecAggError, SessionSpec


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
        return f"secagg — the aggregator learns only sums; {self.describe_session()}"

    def describe_session(self) -> str:
        """The secure sum's threshold, mask graph and tail guard, for the operator."""
        threshold = f"{self.threshold} shares" if self.threshold else "more than two thirds"
        graph = f"{self.neighbours} neighbours per silo (SecAgg+)" if self.neighbours else "every silo pair"
        return f"threshold {threshold}, masks over {graph}, {self.describe_guard()}"

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


class PolicyRefusal(SecAggError):
    """A session below this silo's policy minimums; the silo does not take part."""


@dataclass(frozen=True)
class SessionPolicy:
    min_participants: int = 3
    threshold_above: Fraction = Fraction(2, 3)
    min_neighbours: int = 0  # 0 accepts only the complete graph

    def problems(self, spec: SessionSpec) -> list[str]:
        found = []
        n = len(spec.participants)
        if n < self.min_participants:
            found.append(f"{n} silos in the {spec.purpose} sum, fewer than policy.min_participants")
        if not spec.complete:
            if not self.min_neighbours:
                found.append(
                    f"a SecAgg+ graph of {spec.neighbours} neighbours per silo; policy.min_neighbours = 0 "
                    "accepts only the complete graph"
                )
            elif spec.neighbours < self.min_neighbours:
                found.append(
                    f"{spec.neighbours} neighbours per silo, fewer than policy.min_neighbours "
                    f"{self.min_neighbours}"
                )
        m, t = spec.holder_count, spec.t
        if not t > self.threshold_above * m:
            found.append(
                f"threshold {t} of {m} share holders is not above {self.threshold_above} of them "
                "(policy.threshold_above)"
            )
        return found

    def check(self, spec: SessionSpec) -> None:
        found = self.problems(spec)
        if found:
            raise PolicyRefusal("; ".join(found))
