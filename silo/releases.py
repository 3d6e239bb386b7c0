"""What this silo has let out, on disk, so that no two releases subtract to its data.

The release gate (`fedlt.aggregation.gate`) decides every release; this is the ledger it writes to, keyed by
what was released (the state a contribution was computed from, the presence vector a census carried),
never by the round, plan or seed the aggregator labels it with. Before its input becomes readable in a sum
(secagg: before the consistency signature; ckks: before decrypting), a silo records the survivor set, and for
the same subject it never releases to another. It also keeps the census it took part in, and every MFSC
disclosure it made, by state and data (`record_disclosure`): the settings it was made with (mask, minimum)
and the digest of its values for good, the values themselves while they fit in `KEPT_DISCLOSURES`. A retry
gets the kept bytes; a disclosure whose values were dropped is made again with its own settings, whatever
the plan asks then, and sent only if it comes out as the same bytes. The ledger is written (and its directory
synced) before the signature leaves, so a silo restarted at any point remembers what it may already have
released.

A census is kept apart by whether this silo could check it (`census`, `unchecked_census`): one it took under
DP (where every silo claims every class) or on the aggregator's word (plaintext) is never the census that a
round hiding inputs without DP guards with, in whatever study.

Every change is a read-modify-write under the file's lock (`privacy.dp.ledger.ledger_lock`, as the privacy
ledger's): the file is re-read, the change checked against what it holds and applied, and the file replaced
atomically, so a second writer on the same state directory neither erases a pin nor pins a subject again to
another silo set.

The ledger is the silo's one, across its studies: it lives at the top of the state directory, and each study
keeps its own progress in `studies/<id>/` (`silo.config.SiloConfig.for_study`). Its keys are versioned
(`fedlt.aggregation.gate.KEY_VERSION`): opening a ledger written before keys named the data notes the keys it
holds as version 2 (`v2_pin`), once, and the gate meets them for as long as the ledger holds them.

Ledgers fail closed (`check_ledgers`): a state directory that shows this silo has worked before (progress,
a pinned roster, a pending upload, a privacy ledger, in it or in any study's folder) but has no release
ledger, or whose release ledger says a privacy ledger was kept that is no longer there, stops the agent (every
study's) instead of starting afresh.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedlt.aggregation.gate import KEY_VERSION, RepeatedRelease
from fedlt.aggregation.tail_guard import Census
from fedlt.atomic import atomic_write_text
from fedlt.errors import FedltError
from privacy.dp.ledger import ledger_lock
from silo.config import STUDY_FOLDERS

LEDGER = "releases.json"
# files a silo writes once it has started working: with any of them present, a missing ledger is a lost one
EVIDENCE = ("progress.json", "pending.json", "roster.json")
BOOK = ("survivors", "censuses", "disclosures")
RESTORE = "restore releases.json from a backup of the state directory"
# where a census this silo could not check is kept: beside, never under, the key of one it checked
UNCHECKED = "unchecked/"
# The disclosures' values kept for retries, newest first, in characters of the file (base64), which is
# rewritten whole at every change: 1 MiB holds about 38 disclosures of 10 classes by 256 features (ResNet-8),
# far more than the rounds a silo's studies have in flight at once; the newest is always kept.
KEPT_DISCLOSURES = 2**20

__all__ = ["LEDGER", "LedgerMissing", "ReleaseLedger", "RepeatedRelease", "check_ledgers"]


class LedgerMissing(FedltError):
    """A ledger this silo kept is gone: starting afresh could release the same data again, so it does not."""


def check_ledgers(state_dir: Path, privacy_ledger: Path) -> None:
    """Refuse to start on a state directory whose ledgers were lost (deleted, or a partial restore);
    `state_dir` is the silo's, which holds the ledgers, with each study's folder in it."""
    releases = state_dir / LEDGER
    # one step under the ledger's lock, the book made where there is none: the agents of a silo's studies
    # start together, and one must not find another's first files before that agent's empty book
    with ledger_lock(releases):
        if not releases.exists():
            seen = _evidence(state_dir) + ([privacy_ledger.name] if privacy_ledger.exists() else [])
            if seen:
                raise LedgerMissing(
                    f"{releases} is missing, but this silo has worked before ({', '.join(seen)} in its state "
                    "directory): without the record of what it released it could release the same data "
                    "again over other silos. Restore releases.json from a backup of the state directory; if "
                    "this silo is truly starting over, move the whole state directory aside first"
                )
            atomic_write_text(releases, json.dumps(_new_book()))
            return
        kept = bool(_read(releases).get("privacy_ledger"))
    if kept and not privacy_ledger.exists():
        raise LedgerMissing(
            f"{privacy_ledger} is missing, but {releases} records that this silo kept one: without it the "
            "silo would spend its differential-privacy budget again. Restore the privacy ledger from a "
            "backup of the state directory"
        )


def _new_book() -> dict:
    return {part: {} for part in BOOK} | {"keys": KEY_VERSION, "v2": []}


def _evidence(state_dir: Path) -> list[str]:
    """The files that show this silo worked before, in its state directory or any study's folder."""
    folders = [state_dir, *sorted(p for p in (state_dir / STUDY_FOLDERS).glob("*") if p.is_dir())]
    found = [folder / name for folder in folders for name in EVIDENCE]
    return [str(p.relative_to(state_dir)) for p in found if p.exists()]


class ReleaseLedger:
    """Thread- and process-safe on one state directory; what it reports is the file as this object last read
    it, on opening or at its last change."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LEDGER
        self._lock = threading.Lock()
        with ledger_lock(self.path):
            if self.path.exists():
                self._book = _read(self.path)
                if self._book.get("keys") != KEY_VERSION:
                    self._book = _upgraded(self._book)
                    self._save(self._book)
            else:
                self._book = _new_book()
                self._save(self._book)
        self._v2 = frozenset(self._book["v2"])  # never grows: no version-2 key is pinned any more

    @property
    def keeps_privacy_ledger(self) -> bool:
        """Whether this silo's privacy ledger file was made (and so must still be there)."""
        with self._lock:
            return bool(self._book.get("privacy_ledger"))

    def note_privacy_ledger(self) -> None:
        """Record that the privacy ledger file exists from now on, so that losing it stops the silo."""
        with self._changing() as book:
            book["privacy_ledger"] = True

    def pin_survivors(self, key: str, survivors: Sequence[str], what: str) -> None:
        """Allow releasing `key` to `survivors` only if it was never released to another set."""
        wanted = sorted(survivors)
        with self._changing() as book:
            pinned = book["survivors"].setdefault(key, wanted)
            if pinned != wanted:
                raise RepeatedRelease(
                    f"this silo already signed the {what} for {', '.join(pinned)}; signing it for "
                    f"{', '.join(wanted)} would let the aggregator subtract the two sums"
                )

    def survivors(self, key: str) -> list[str] | None:
        """The survivor set this silo signed for `key`, if any."""
        with self._lock:
            return self._book["survivors"].get(key)

    def v2_pin(self, key: str) -> list[str] | None:
        """The survivor set `key`, a version-2 key, was pinned to before the upgrade, if any. Read from this
        object's book: version-2 pins are never added, and no pin ever changes (`_reread` checks)."""
        return self.survivors(key) if key in self._v2 else None

    def census(self, key: str) -> Census | None:
        """The census kept for `key` that this silo checked: the only kind a round that hides inputs without
        DP may guard with. A census kept before censuses were marked is not one: it may have been taken
        under DP or on the aggregator's word (`unchecked_census`), and taking it anew costs one census over
        the same silos, which the silo allows."""
        saved = self._saved_census(key)
        return _census(saved) if saved is not None and saved.get("checked") is True else None

    def unchecked_census(self, key: str) -> Census | None:
        """The census kept for `key` that this silo took without checking it (under DP every silo claims
        every class; under plaintext it is the aggregator's reading), or one kept before censuses were
        marked."""
        saved = self._saved_census(UNCHECKED + key)
        if saved is None:
            older = self._saved_census(key)
            saved = older if older is not None and "checked" not in older else None
        return None if saved is None else _census(saved)

    def record_census(self, key: str, census: Census) -> None:
        """Keep `census`, which this silo computed itself without DP, for `key`."""
        self._record_census(key, census, checked=True)

    def record_unchecked_census(self, key: str, census: Census) -> None:
        """Keep `census`, which this silo could not check, for `key`: apart from a checked one, so that
        neither replaces the other (a study under DP and one without, over the same data, each keeps its
        own)."""
        self._record_census(UNCHECKED + key, census, checked=False)

    def _saved_census(self, key: str) -> dict | None:
        with self._lock:
            return self._book["censuses"].get(key)

    def _record_census(self, key: str, census: Census, *, checked: bool) -> None:
        saved = {
            "silos": list(census.silos),
            "counts": list(census.counts),
            "records": list(census.records),
            "checked": checked,
        }
        with self._changing() as book:
            book["censuses"][key] = saved

    def disclosure(self, key: str) -> bytes | None:
        """The values already disclosed for `key` (a state and data), to be sent again unchanged; None once
        they are no longer kept (`disclosure_settings` then says how to make them again)."""
        with self._lock:
            saved = self._book["disclosures"].get(key, {})
        return base64.b64decode(saved["values"]) if "values" in saved else None

    def disclosure_settings(self, key: str) -> dict[str, Any] | None:
        """What the disclosure of `key` was made with, kept for good: a disclosure made again for `key` is
        made with these, whatever the plan asks now, so the two cannot tell real class means from masks."""
        with self._lock:
            saved = self._book["disclosures"].get(key, {})
        return dict(saved["made_with"]) if "made_with" in saved else None

    def record_disclosure(self, key: str, values: bytes, made_with: Mapping[str, Any] | None = None) -> bytes:
        """Keep `values` as the disclosure of `key`, made with `made_with` (None: never dropped, as it could
        not be made again), and return the values to send: those another agent of this silo kept first, if
        any. RepeatedRelease if `key` was disclosed before as other values than these."""
        digest = hashlib.sha256(values).hexdigest()
        with self._changing() as book:
            kept = book["disclosures"]
            saved = kept.pop(key, None)
            if saved is not None and "values" in saved:
                kept[key] = saved
                return base64.b64decode(saved["values"])
            if saved is not None and saved["sha256"] != digest:
                kept[key] = saved
                raise RepeatedRelease(
                    "this silo disclosed other class means for this state and data before (its features "
                    "no longer compute to the same values); disclosing these too would tell its real class "
                    "means from its masks"
                )
            made_with = saved.get("made_with") if saved is not None else made_with
            entry = {"sha256": digest, "values": base64.b64encode(values).decode()}
            kept[key] = entry | ({"made_with": dict(made_with)} if made_with is not None else {})
            _drop_old_values(kept)
        return values

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict]:
        """The book as the file holds it now, under the file's lock; written back if the caller changed it
        (and not at all if the caller raised)."""
        with self._lock, ledger_lock(self.path):
            book = self._reread()
            before = json.dumps(book)
            yield book
            if json.dumps(book) != before:
                self._save(book)
            self._book = book

    def _reread(self) -> dict:
        """The file's book; one that lost a pin this object saw (deleted, or put back from an older copy
        while the silo ran) is refused rather than written over: a lost pin would allow a second release."""
        if not self.path.exists():
            raise LedgerMissing(
                f"{self.path} was removed while this silo ran: without it the silo could release the same "
                f"data again over other silos; {RESTORE}"
            )
        book = _read(self.path)
        kept = all(book["survivors"].get(k) == pinned for k, pinned in self._book["survivors"].items())
        disclosed = book["disclosures"]
        kept &= all(
            disclosed.get(k, {}).get("sha256") == d["sha256"] for k, d in self._book["disclosures"].items()
        )
        if not kept or (self._book.get("privacy_ledger") and not book.get("privacy_ledger")):
            raise LedgerMissing(
                f"{self.path} no longer holds releases this silo recorded (it was replaced by an older copy "
                f"while the silo ran); {RESTORE}"
            )
        return book

    def _save(self, book: dict) -> None:
        atomic_write_text(self.path, json.dumps(book))


def _drop_old_values(disclosures: dict) -> None:
    """Drop the values of the oldest disclosures past `KEPT_DISCLOSURES` (never the newest one's, nor those
    of one whose settings are unknown); their settings and digests stay."""
    size = 0
    for age, entry in enumerate(reversed(disclosures.values())):  # age 0: the newest
        values = entry.get("values", "")
        if age and "made_with" in entry and size + len(values) > KEPT_DISCLOSURES:
            entry.pop("values", None)
        else:
            size += len(values)


def _census(saved: dict) -> Census:
    return Census.of(saved["silos"], saved["counts"], saved.get("records", ()))


def _upgraded(book: dict) -> dict:
    """A ledger of an agent from before keys named the data: every key it pinned is a version-2 key."""
    return {**book, "keys": KEY_VERSION, "v2": sorted(book["survivors"])}


def _read(path: Path) -> dict:
    """The book in `path`; a damaged one counts as lost, since it could not refuse a second release."""
    try:
        book = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LedgerMissing(f"{path} is not a readable release ledger ({exc}); {RESTORE}") from None
    if isinstance(book, dict) and "disclosures" not in book:
        book = _one_disclosure(book, path)
    if not isinstance(book, dict) or not all(isinstance(book.get(part), dict) for part in BOOK):
        raise LedgerMissing(f"{path} is not a release ledger of this format; {RESTORE}")
    if not all(_readable_disclosure(d) for d in book["disclosures"].values()):
        raise LedgerMissing(f"{path} holds a damaged disclosure; {RESTORE}")
    if book.get("keys") == KEY_VERSION and not isinstance(book.get("v2"), list):
        raise LedgerMissing(f"{path} lost the list of its version-2 keys; {RESTORE}")
    return book


def _one_disclosure(book: dict, path: Path) -> dict:
    """A ledger from before disclosures were kept by key held one, the latest, under "disclosure": it is
    kept as the only one, with its values for good (the settings it was made with are unknown)."""
    older = {k: v for k, v in book.items() if k != "disclosure"}
    slot = book.get("disclosure")
    if not isinstance(slot, dict):
        return older  # refused by the caller, as any book without its parts
    if not slot:
        return older | {"disclosures": {}}
    key, encoded = slot.get("key"), slot.get("values")
    try:
        values = base64.b64decode(encoded, validate=True) if isinstance(key, str) else None
    except (TypeError, ValueError):
        values = None
    if values is None:
        raise LedgerMissing(f"{path} holds a damaged disclosure; {RESTORE}")
    saved = {"sha256": hashlib.sha256(values).hexdigest(), "values": encoded}
    return older | {"disclosures": {key: saved}}


def _readable_disclosure(saved: Any) -> bool:
    """A disclosure as `record_disclosure` keeps it: its digest, its values while kept, its settings if
    known; one without settings keeps its values (it could not be made again)."""
    return (
        isinstance(saved, dict)
        and isinstance(saved.get("sha256"), str)
        and isinstance(saved.get("values", ""), str)
        and isinstance(saved.get("made_with", {}), dict)
        and ("values" in saved or "made_with" in saved)
    )
