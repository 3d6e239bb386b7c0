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
a function of the state the silo trains from and its data; plan text, seed, round number, attempt, phase label
and study label change it little or not at all, so two sums over silo sets that differ by one silo would
subtract to that silo's input (exactly, or closely enough). The key is therefore the consortium, the *content*
of the starting state (`GlobalState.content_digest`, which leaves out the round number the aggregator labels
it with) and the data the silo computed it from (`data_digest` of the plan's prepared arrays): one survivor
set per state and data, whatever the RoundSpec says. Two studies of one silo over the same data, from the same
state, meet the same key; over different data they do not, since their contributions differ (before keys
named the data, two studies over different data whose plans start from the same seeded model refused each
other).

Replaying an old round, under any new label, trains from an old state and the old data, and meets the old
key.

A census is keyed by the presence it carries (the names of the classes the silo holds), and by nothing of the
data: it *is* that presence. Were the same presence released twice, in a census over a set with silo v and in
one over the same set without v (two studies over different data, where every silo holds the same classes in
both), the two sums would subtract to v's presence; so each of the others refuses the second census, whatever
study, plan or data asks for it: a silo gives its class presence over one silo set per consortium.

Keys are versioned (`KEY_VERSION`). A release ledger written before keys named the data holds version-2 keys
(the same parts, no data); while it holds any, every release also meets its version-2 key (`Ledger.v2_pin`),
so what a silo released before the upgrade is still released over one silo set only.

What stays possible, and is stated in docs/threat-model.md: an aggregator may send a *slightly different*
state (it chooses the model under secagg), or a plan that prepares the same files slightly differently (image
size, table encoding), each a new key and an approximately equal contribution; only differential privacy
bounds that, and only under ckks do silos check the state they train from (signed by every counted silo).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedlt.aggregation.halves import SiloSide, SumAborted, SumSpec

KEY_VERSION = 3


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
    """What a release is of, as the silo itself knows it: `kind`, the bytes that identify it, and the digest
    of the data it was computed from (`data_digest`; "" where the release is a value of its own, a census)."""

    kind: str  # "census", "contribution", "evaluation"
    identity: bytes
    data: str = ""

    def key(self, consortium: str) -> str:
        return _key(f"fedlt/release/v{KEY_VERSION}", consortium, self.kind, self.identity, self.data)

    def v2_key(self, consortium: str) -> str:
        """The key a silo gave this release before keys named the data (`KEY_VERSION` 2)."""
        return _key("fedlt/release/v2", consortium, self.kind, self.identity)

    @classmethod
    def fresh(cls, kind: str) -> Subject:
        """A release nothing else can repeat (the simulator's rounds: one call, one state)."""
        return cls(kind, secrets.token_bytes(16))


def _key(*parts: bytes | str) -> str:
    encoded = [p.encode() if isinstance(p, str) else p for p in parts]
    return hashlib.sha256(b"".join(len(p).to_bytes(4, "big") + p for p in encoded)).hexdigest()


def data_digest(*arrays: np.ndarray) -> str:
    """SHA-256 of the arrays a silo computes a release from (a plan's prepared samples and labels): each one's
    dtype, shape and bytes. Computed once per prepared dataset; it names data, it is not a secret (the
    key it goes into is a hash too, and stays on the silo)."""
    digest = hashlib.sha256(b"fedlt/data/v1")
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8))  # its bytes, uncopied (none for an empty array)
    return digest.hexdigest()


class Ledger(Protocol):
    """Where a silo keeps the survivor set it released each subject for (`silo.releases` on disk)."""

    def pin_survivors(self, key: str, survivors: Sequence[str], what: str) -> None:
        """Record `survivors` for `key`, or raise `RepeatedRelease` if another set is recorded."""
        ...

    def v2_pin(self, key: str) -> list[str] | None:
        """The survivor set a version-2 `key` was pinned to before the upgrade, if the ledger holds one."""
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

    def v2_pin(self, key: str) -> list[str] | None:
        return None  # it lives as long as the process: nothing in it is older than version 3


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
            earlier = self._ledger.v2_pin(subject.v2_key(self.consortium))
            if earlier is not None and earlier != list(counted):
                raise RepeatedRelease(
                    f"this silo already released the {what} for {', '.join(earlier)} (recorded before this "
                    f"version of the agent); releasing it for {', '.join(counted)} would let the aggregator "
                    "subtract the two sums"
                )
            self._ledger.pin_survivors(subject.key(self.consortium), counted, what)


_WHAT = {
    "census": "class presence (the census)",
    "contribution": "contribution computed from this state",
    "evaluation": "evaluation counts of this state",
}
