"""A silo's privacy ledger: every DP mechanism it ran on its records, with its RDP curve, on disk.

The ledger is asked before the work, not after: `charge` writes the entry (atomically) and only then does the
silo train or release, so a silo killed half-way remembers the spending it may already have done; work that
would take the total past the budget is refused with `BudgetExceeded`. Totals are composed in Rényi DP over
`privacy.dp.accountant.ORDERS` and converted to (ε, δ) once.

Every write is a read-modify-write under an exclusive lock of the file (`ledger_lock`): the file is re-read,
the entry checked against everything in it and appended, and the file replaced atomically. Two writers that
each kept their own copy (two agents on one state directory, or a process that bypasses the agent's lock)
would otherwise erase each other's entries, and each would spend the whole budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlt.atomic import atomic_write_text
from fedlt.errors import FedltError
from privacy.dp.accountant import ORDERS, epsilon

FORMAT = 1


class BudgetExceeded(FedltError):
    """The work asked for would spend more than the silo's (ε, δ) budget; the silo refuses it."""


class LedgerError(FedltError):
    """A ledger file that cannot be read as this silo's ledger; never silently replaced."""


@dataclass(frozen=True)
class Budget:
    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not self.epsilon > 0 or not 0 < self.delta < 1:
            raise ValueError(f"a budget needs ε > 0 and 0 < δ < 1, got ε = {self.epsilon}, δ = {self.delta}")


@contextlib.contextmanager
def ledger_lock(path: Path) -> Iterator[None]:
    """Hold `path`'s lock for one read-modify-write, blocking while another thread or process holds it.

    The lock is taken on a file beside the ledger (`<name>.lock`), never on the ledger itself: each write
    replaces the ledger's inode, so a lock on it would guard a file nobody reads any more.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f"{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class PrivacyLedger:
    """Thread- and process-safe on one file; what it reports (`entries`, `spent`, ...) is the file as this
    object last read it, on opening or at its last write. `path` None keeps the ledger in memory (the
    simulator saves it with its checkpoint)."""

    def __init__(self, budget: Budget, path: Path | None = None) -> None:
        self.budget = budget
        self.path = path
        self._lock = threading.Lock()
        self._entries: list[dict] = []
        self._total = np.zeros(len(ORDERS))  # the entries' RDP curves summed, kept as they are added
        if path is not None and path.exists():
            self.restore(_read(path))

    def __getstate__(self) -> dict:
        """An in-memory ledger pickles (a simulated silo's, which moves with its work); one on disk stays
        where its file is."""
        if self.path is not None:
            raise TypeError(f"the ledger in {self.path} stays with its file: open it where it lies")
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._total = np.array(self._total)  # writable: Ray hands arrays over read-only
        self._lock = threading.Lock()

    def restore(self, entries: list[dict]) -> None:
        """Replace the in-memory entries with saved ones (a simulator resuming from its checkpoint)."""
        with self._lock:
            self._take(entries)

    @property
    def entries(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self._entries]

    def spent_rdp(self) -> np.ndarray:
        with self._lock:
            return self._total.copy()

    def spent(self) -> float:
        """ε spent so far at the budget's δ."""
        return epsilon(self.spent_rdp(), self.budget.delta)

    def remaining(self) -> float:
        return max(self.budget.epsilon - self.spent(), 0.0)

    def spent_rdp_outside(self, run: str) -> np.ndarray:
        """What every run but `run` spent (entries of ledgers older than run tags count as other runs)."""
        with self._lock:
            outside = [e["rdp"] for e in self._entries if e.get("run") != run]
        return np.sum(np.asarray(outside, dtype=np.float64), axis=0) if outside else np.zeros(len(ORDERS))

    def charge(
        self,
        mechanism: str,
        rdp: np.ndarray,
        *,
        what: str,
        run: str = "",
        once_per: Sequence[str] = (),
        **params: Any,
    ) -> dict:
        """Record one mechanism run before it runs, tagged with the `run` (plan) it is part of;
        BudgetExceeded (nothing recorded) if it would not fit. A release made once and reused, such as a
        noised count, names in `once_per` the params that say what it released (the records counted): an
        entry for `what` with the same values of those, by any run or writer (the file is re-read under its
        lock first, in the same hold), is returned instead, and nothing is charged."""
        rdp = np.asarray(rdp, dtype=np.float64)
        if rdp.shape != (len(ORDERS),):
            raise ValueError(f"an RDP curve has {len(ORDERS)} orders, got shape {rdp.shape}")
        if not np.all(rdp >= 0):  # a cost is >= 0 at every order (inf: unbounded, refused below); no NaN
            raise ValueError("an RDP curve is >= 0 at every order (no negative values, no NaN)")
        with self._lock, self._file_lock():
            self._reread()
            made = self._made(what, {name: params[name] for name in once_per}) if once_per else None
            if made is not None:
                return made
            after = epsilon(self._total + rdp, self.budget.delta)
            if after > self.budget.epsilon:
                before = epsilon(self._total, self.budget.delta)
                raise BudgetExceeded(
                    f"refusing {what}: it would take this silo's privacy spending from ε = {before:.3g} to "
                    f"ε = {_show(after)} (δ = {self.budget.delta:g}), past its budget of ε = "
                    f"{self.budget.epsilon:g}; it does not fit in what is left of the silo's budget"
                )
            entry = {
                "when": round(time.time(), 3),
                "mechanism": mechanism,
                "what": what,
                "run": run,
                "params": dict(params),
                "epsilon_after": after,
                "rdp": [float(v) for v in rdp],
            }
            entry = json.loads(json.dumps(entry))  # as the file holds it, so a re-read compares equal
            self._entries.append(entry)
            self._total += rdp
            self._save()
        return dict(entry)

    def keep(self) -> None:
        """Write the ledger now, even with no entries: from then on its file must be there (the silo's
        release ledger notes it, and a lost privacy ledger stops the silo instead of starting over)."""
        with self._lock, self._file_lock():
            self._reread()
            self._save()

    def _made(self, what: str, params: Mapping[str, Any]) -> dict | None:
        """The latest entry for `what` with these values of `params` (compared as the file holds them)."""
        wanted = json.loads(json.dumps(params))
        for entry in reversed(self._entries):
            recorded = entry["params"]
            if entry["what"] == what and all(recorded.get(k) == v for k, v in wanted.items()):
                return dict(entry)
        return None

    def describe(self) -> str:
        entries = self.entries
        lines = [
            f"budget ε = {self.budget.epsilon:g} at δ = {self.budget.delta:g}; spent ε = {self.spent():.4g}; "
            f"remaining ε = {self.remaining():.4g}; {len(entries)} entries"
        ]
        for e in entries:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["when"]))
            params = ", ".join(f"{k} {_show(v)}" for k, v in e["params"].items())
            lines.append(
                f"  {when}  {e['mechanism']:<9} {e['what']:<28} {params}  → ε {e['epsilon_after']:.4g}"
            )
        return "\n".join(lines)

    def _file_lock(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.path is None else ledger_lock(self.path)

    def _reread(self) -> None:
        """Take in what other writers added since this object last read the file (under `ledger_lock`).

        Writers only ever append, so what this object saw is the start of the file's entries; a file that
        lost some of them (deleted, or put back from an older copy while the silo ran) is refused, never
        written over, as a lost ledger is at start (`silo.releases.check_ledgers`)."""
        if self.path is None:
            return
        entries = _read(self.path, known=self._entries) if self.path.exists() else []
        if entries[: len(self._entries)] != self._entries:
            raise LedgerError(
                f"{self.path}: privacy ledger entries this silo recorded are gone (the file was deleted or "
                "replaced by an older copy while the silo ran); restore it from a backup"
            )
        self._take(entries)

    def _take(self, entries: list[dict]) -> None:
        self._entries = [dict(e) for e in entries]
        self._total = np.zeros(len(ORDERS))
        for e in self._entries:  # in order, as `charge` adds them: a re-read total equals the running one
            self._total += np.asarray(e["rdp"], dtype=np.float64)

    def _save(self) -> None:
        if self.path is None:
            return
        atomic_write_text(
            self.path, json.dumps({"format": FORMAT, "orders": ORDERS, "entries": self._entries})
        )


def _read(path: Path, *, known: Sequence[dict] = ()) -> list[dict]:
    """The file's entries. Those it starts with that equal `known` (entries the caller checked when it read
    or wrote them) are not checked again, so a re-read costs the new entries only."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LedgerError(
            f"{path}: not a readable privacy ledger ({exc}); restore it from a backup"
        ) from None
    if (
        not isinstance(saved, Mapping)
        or saved.get("format") != FORMAT
        or tuple(saved.get("orders", ())) != ORDERS
    ):
        raise LedgerError(f"{path}: a privacy ledger of another format; restore it from a backup")
    entries = saved.get("entries")
    skip = len(known) if isinstance(entries, list) and entries[: len(known)] == list(known) else 0
    if not isinstance(entries, list) or not all(_readable(e) for e in entries[skip:]):
        raise LedgerError(f"{path}: a privacy ledger with damaged entries; restore it from a backup")
    return entries


_ENTRY_KEYS = {"when", "mechanism", "what", "params", "epsilon_after", "rdp"}


def _readable(entry: Any) -> bool:
    """An entry as `charge` writes it: its keys, and an RDP curve of one cost >= 0 per order."""
    if not isinstance(entry, Mapping) or not entry.keys() >= _ENTRY_KEYS:
        return False
    if not isinstance(entry["params"], Mapping):
        return False
    rdp = entry["rdp"]
    return (
        isinstance(rdp, list)
        and len(rdp) == len(ORDERS)
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in rdp)
    )


def _show(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)
