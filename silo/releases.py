"""What this silo has let out, on disk, so that no two releases subtract to its data.

A silo's contribution to a round is a function of the round (state, plan, seed) and its data, so every attempt
of the round carries the same vector. An aggregator that ran the round over S \\ {v}, aborted, and ran it
again over S would learn v's input from the difference. The guard is on the honest side of that subtraction:
before signing the consistency round (the signature without which nobody's masks come off), a silo records the
survivor set it signs for, and for the same round it never signs another. Likewise one census per phase, and
one disclosure per round (a retry gets the same bytes). The ledger is written before the signature leaves, so
a silo restarted at any point remembers what it may already have released.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Sequence
from pathlib import Path

from fedlt.aggregation.tail_guard import Census
from fedlt.atomic import atomic_write_text
from privacy.secagg.protocol import ProtocolViolation

LEDGER = "releases.json"


class RepeatedRelease(ProtocolViolation):
    """A second release of one round (or phase census) over other silos; the silo refuses it."""


class ReleaseLedger:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LEDGER
        self._lock = threading.Lock()
        self._book = (
            json.loads(self.path.read_text())
            if self.path.exists()
            else {"survivors": {}, "censuses": {}, "disclosure": {}}
        )

    def pin_survivors(self, key: str, survivors: Sequence[str], what: str) -> None:
        """Allow signing for `survivors` only if this release was never signed for another set."""
        wanted = sorted(survivors)
        with self._lock:
            pinned = self._book["survivors"].get(key)
            if pinned is not None and pinned != wanted:
                raise RepeatedRelease(
                    f"this silo already signed the {what} for {', '.join(pinned)}; signing it for "
                    f"{', '.join(wanted)} would let the aggregator subtract the two sums"
                )
            if pinned is None:
                self._book["survivors"][key] = wanted
                self._save()

    def survivors(self, key: str) -> list[str] | None:
        """The survivor set this silo signed for `key`, if any."""
        with self._lock:
            return self._book["survivors"].get(key)

    def census(self, phase: str) -> Census | None:
        with self._lock:
            saved = self._book["censuses"].get(phase)
        return None if saved is None else Census.of(saved["silos"], saved["counts"])

    def record_census(self, phase: str, census: Census) -> None:
        with self._lock:
            self._book["censuses"][phase] = {"silos": list(census.silos), "counts": list(census.counts)}
            self._save()

    def disclosure(self, key: str) -> bytes | None:
        """The values already disclosed for `key` (this round's state), to be sent again unchanged."""
        with self._lock:
            saved = self._book["disclosure"]
        return base64.b64decode(saved["values"]) if saved.get("key") == key else None

    def record_disclosure(self, key: str, values: bytes) -> None:
        with self._lock:
            self._book["disclosure"] = {"key": key, "values": base64.b64encode(values).decode()}
            self._save()

    def _save(self) -> None:
        atomic_write_text(self.path, json.dumps(self._book))
