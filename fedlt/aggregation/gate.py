"""The release gate: every release a silo makes, under every layer, passes here before anything leaves.

A layer's silo half decides *when* its input becomes readable in a sum (secagg: the consistency signature;
ckks: the decryption of an agreed ciphertext sum); this gate decides *whether*. The round driver
(`round_sums.SiloRound`) builds every half through `admit` and hands it a `may_release` that ends here, so no
layer and no agent reaches a half without passing the gate. It checks, with the silo's own policy and roster:

- before any work on a sum (`admit`): every listed silo is a member of the silo's roster (no ghost ids that
  inflate a count), at least `Floors.participants` of them, and the layer's own refusals (thresholds, keys);
- at the point of release (`release`): the survivors are listed silos, at least `min_counted` of them, and the
  release ledger allows this survivor set for what is released.

**The ledger is keyed by what the silo releases, never by labels the aggregator chooses.** A contribution is
a function of the state the silo trains from and its data; plan text, seed, round number, attempt and phase
label change it little or not at all, so two sums over silo sets that differ by one silo would subtract to
that silo's input (exactly, or closely enough). The key is therefore the consortium and the *content* of the
starting state (`GlobalState.content_digest`, which leaves out the round number the aggregator labels it
with): one survivor set per state, whatever the RoundSpec says. A census is keyed by the presence vector the
silo sends, which does not change between phases, plans or studies, so a silo gives its class presence over
one silo set per consortium (and data). A legitimately new study starts from a new state (its own seeded
initial model) and so gets new keys; replaying an old round, under any new label, trains from an old state
and meets the old key.

What stays possible, and is stated in docs/threat-model.md: an aggregator may send a *slightly different*
state (it chooses the model under secagg), which is a new key and an approximately equal contribution; only
differential privacy bounds that, and only under ckks do silos check the state they train from (signed by
every counted silo).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from fedlt.aggregation.halves import SiloSide, SumAborted, SumSpec


class GateRefusal(SumAborted):
    """A release this silo's gate refuses: the silo leaves the sum, and nothing of its input is readable."""


class RepeatedRelease(GateRefusal):
    """A second release of the same data over another silo set; the silo refuses it."""


@dataclass(frozen=True)
class Floors:
    """The policy's floors for every sum, whatever the layer: a sum of two reveals the other's input to
    either silo (the sum minus its own), so three is the least a silo should accept."""

    participants: int = 3  # silos a sum may list
    survivors: int = 3  # silos a sum this silo releases into must count, once dropouts are known


@dataclass(frozen=True)
class Subject:
    """What a release is of, as the silo itself knows it: `kind` and the bytes that identify the data."""

    kind: str  # "census", "contribution", "evaluation"
    identity: bytes

    def key(self, consortium: str) -> str:
        parts = (b"fedlt/release/v2", consortium.encode(), self.kind.encode(), self.identity)
        return hashlib.sha256(b"".join(len(p).to_bytes(4, "big") + p for p in parts)).hexdigest()

    @classmethod
    def fresh(cls, kind: str) -> Subject:
        """A release nothing else can repeat (the simulator's rounds: one call, one state)."""
        return cls(kind, secrets.token_bytes(16))


class Ledger(Protocol):
    """Where a silo keeps the survivor set it released each subject for (`silo.releases` on disk)."""

    def pin_survivors(self, key: str, survivors: Sequence[str], what: str) -> None:
        """Record `survivors` for `key`, or raise `RepeatedRelease` if another set is recorded."""
        ...


class MemoryLedger:
    """A ledger that lives as long as the process: the simulator's silos, which keep nothing on disk."""

    def __init__(self) -> None:
        self._pinned: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def pin_survivors(self, key: str, survivors: Sequence[str], what: str) -> None:
        wanted = sorted(survivors)
        with self._lock:
            pinned = self._pinned.setdefault(key, wanted)
        if pinned != wanted:
            raise RepeatedRelease(
                f"this silo already released the {what} for {', '.join(pinned)}; releasing it for "
                f"{', '.join(wanted)} would let the aggregator subtract the two sums"
            )


class ReleaseGate:
    """One silo's gate, for every sum of every round and study it takes part in.

    `members` gives the silo ids of the roster in force (read at each use: rosters change); `ledger` keeps
    what was released, for which survivors."""

    def __init__(
        self,
        *,
        consortium: str,
        floors: Floors,
        members: Callable[[], Collection[str]],
        ledger: Ledger,
    ) -> None:
        self.consortium, self.floors = consortium, floors
        self._members, self._ledger = members, ledger

    def members(self) -> Collection[str]:
        """The silo ids of the roster in force."""
        return self._members()

    def admit(self, spec: SumSpec, side: SiloSide) -> None:
        """Before this silo does any work on `spec`: refuse what no completed sum could make safe."""
        problems = self.problems(spec, side)
        if problems:
            raise GateRefusal(f"{spec.round_id}: {spec.purpose} sum refused: " + "; ".join(problems))

    def problems(self, spec: SumSpec, side: SiloSide) -> list[str]:
        found = []
        strangers = sorted(set(spec.silos) - set(self._members()))
        if strangers:
            found.append(f"it lists {', '.join(strangers)}, not silos of this silo's roster")
        if side.hides_inputs and len(spec.silos) < self.floors.participants:
            found.append(
                f"it lists {len(spec.silos)} silos, fewer than policy.min_participants "
                f"{self.floors.participants}"
            )
        return found + side.problems(spec)

    def min_counted(self, spec: SumSpec, side: SiloSide) -> int:
        """The fewest silos a sum this silo releases into will count: what distributed DP noise is calibrated
        for. A sum that would count fewer is refused at `release`, so the noise is never short."""
        if not side.hides_inputs:
            return side.min_counted(spec)
        return min(len(spec.silos), max(self.floors.survivors, side.min_counted(spec)))

    def release(
        self, spec: SumSpec, side: SiloSide, survivors: Sequence[str], subject: Subject | None
    ) -> None:
        """At the point where this silo's input becomes readable in a sum over `survivors`: refuse, or record
        the release first (so a silo killed right after remembers it). `subject` None releases nothing a
        ledger must remember (a DP census, whose every flag is 1)."""
        counted = tuple(sorted(set(survivors)))
        if len(counted) != len(survivors) or not set(counted) <= set(spec.silos):
            raise GateRefusal(f"{spec.round_id}: the {spec.purpose} sum counts silos it does not list")
        strangers = sorted(set(counted) - set(self._members()))
        if strangers:
            raise GateRefusal(f"{spec.round_id}: the {spec.purpose} sum counts non-members {strangers}")
        needed = self.min_counted(spec, side)
        if len(counted) < needed:
            raise GateRefusal(
                f"{spec.round_id}: the {spec.purpose} sum would count {len(counted)} silos, fewer than the "
                f"{needed} this silo releases into (policy.min_survivors)"
            )
        if subject is not None:
            what = _WHAT.get(subject.kind, subject.kind)
            self._ledger.pin_survivors(subject.key(self.consortium), counted, what)


_WHAT = {
    "census": "class presence (the census)",
    "contribution": "contribution computed from this state",
    "evaluation": "evaluation counts of this state",
}
