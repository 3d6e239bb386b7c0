"""What this silo has let out, on disk, so that no two releases subtract to its data.

The release gate (`fedlt.aggregation.gate`) decides every release; this is the ledger it writes to, keyed by
what was released (the state a contribution was computed from, the presence vector a census carried),
never by the round, plan or seed the aggregator labels it with. Before its input becomes readable in a sum
(secagg: before the consistency signature; ckks: before decrypting), a silo records the survivor set, and for
the same subject it never releases to another. It also keeps the census it took part in, and one disclosure
(a retry gets the same bytes). The ledger is written (and its directory synced) before the signature leaves,
so a silo restarted at any point remembers what it may already have released.

Ledgers fail closed (`check_ledgers`): a state directory that shows this silo has worked before (progress,
a pinned roster, a pending upload, a privacy ledger) but has no release ledger, or whose release ledger says
a privacy ledger was kept that is no longer there, stops the agent instead of starting afresh.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Sequence
from pathlib import Path

from fedlt.aggregation.gate import RepeatedRelease
from fedlt.aggregation.tail_guard import Census
from fedlt.atomic import atomic_write_text
from fedlt.errors import FedltError

LEDGER = "releases.json"
# files a silo writes once it has started working: with any of them present, a missing ledger is a lost one
EVIDENCE = ("progress.json", "pending.json", "roster.json")

__all__ = ["LEDGER", "LedgerMissing", "ReleaseLedger", "RepeatedRelease", "check_ledgers"]


class LedgerMissing(FedltError):
    """A ledger this silo kept is gone: starting afresh could release the same data again, so it does not."""


def check_ledgers(state_dir: Path, privacy_ledger: Path) -> None:
    """Refuse to start on a state directory whose ledgers were lost (deleted, or a partial restore)."""
    releases = state_dir / LEDGER
    if not releases.exists():
        seen = [p.name for p in (*(state_dir / n for n in EVIDENCE), privacy_ledger) if p.exists()]
        if seen:
            raise LedgerMissing(
                f"{releases} is missing, but this silo has worked before ({', '.join(seen)} in its state "
                "directory): without the record of what it released it could release the same data again "
                "over other silos. Restore releases.json from a backup of the state directory; if this "
                "silo is truly starting over, move the whole state directory aside first"
            )
        return
    if ReleaseLedger(state_dir).keeps_privacy_ledger and not privacy_ledger.exists():
        raise LedgerMissing(
            f"{privacy_ledger} is missing, but {releases} records that this silo kept one: without it the "
            "silo would spend its differential-privacy budget again. Restore the privacy ledger from a "
            "backup of the state directory"
        )


class ReleaseLedger:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LEDGER
        self._lock = threading.Lock()
        if self.path.exists():
            self._book = json.loads(self.path.read_text())
        else:
            self._book = {"survivors": {}, "censuses": {}, "disclosure": {}}
            self._save()

    @property
    def keeps_privacy_ledger(self) -> bool:
        """Whether this silo's privacy ledger file was made (and so must still be there)."""
        with self._lock:
            return bool(self._book.get("privacy_ledger"))

    def note_privacy_ledger(self) -> None:
        """Record that the privacy ledger file exists from now on, so that losing it stops the silo."""
        with self._lock:
            if not self._book.get("privacy_ledger"):
                self._book["privacy_ledger"] = True
                self._save()

    def pin_survivors(self, key: str, survivors: Sequence[str], what: str) -> None:
        """Allow releasing `key` to `survivors` only if it was never released to another set."""
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

    def census(self, key: str) -> Census | None:
        with self._lock:
            saved = self._book["censuses"].get(key)
        return None if saved is None else Census.of(saved["silos"], saved["counts"], saved.get("records", ()))

    def record_census(self, key: str, census: Census) -> None:
        with self._lock:
            saved = {
                "silos": list(census.silos),
                "counts": list(census.counts),
                "records": list(census.records),
            }
            self._book["censuses"][key] = saved
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
