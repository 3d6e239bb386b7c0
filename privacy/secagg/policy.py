"""A silo's minimums for every secure sum it joins: the aggregator proposes the session, the silo disposes.

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

from privacy.secagg.protocol import SecAggError, SessionSpec


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
