"""One process per directory, for as long as it lives: a silo agent's state directory, an aggregator's data
directory.

A state directory holds one silo's ledgers, progress, pending upload, pinned roster and keys. Two agents
sharing one each keep their own copy of that state, and the last to write wins: privacy-ledger entries and
release-ledger pins disappear, and with them the silo's DP budget and its one release per state. A data
directory holds an aggregator's store: two aggregators on one would split the silos between them and stall
every round. So the process takes an exclusive `flock` on a lock file in its directory before it reads
anything there, and keeps the descriptor open until it ends. The kernel drops the lock with the process
however it ends, so a SIGKILLed one leaves no stale lock behind (the file stays; the lock does not). The file
records who holds it (pid, host, since when) only so that a second process can say whom it met.

The ledgers also lock their own files for each write (`privacy.dp.ledger.ledger_lock`), for writers that do
not run an agent.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import socket
import time
import weakref
from pathlib import Path

from fedlt.errors import FedltError

AGENT_LOCK = "agent.lock"  # a silo agent's, in its state directory
AGGREGATOR_LOCK = "aggregator.lock"  # an aggregator's, in its data directory


class DirectoryBusy(FedltError):
    """Another process holds this directory: a second one on it would lose or split the first's records."""


class DirectoryLock:
    """The held lock of one directory; `take` it, keep it for the process's life."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._close = weakref.finalize(self, os.close, fd)  # on release, collection or interpreter exit

    @classmethod
    def take(cls, directory: Path, *, name: str = AGENT_LOCK) -> DirectoryLock:
        """The lock `name` of `directory`, or DirectoryBusy naming its holder; never waits."""
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _lock(fd):
                raise DirectoryBusy(_BUSY[name].format(directory=directory, holder=_holder(fd)))
        except BaseException:
            os.close(fd)
            raise
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": round(time.time())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Let another process take the directory (an object that ends before its process does)."""
        self._close()


_BUSY = {
    AGENT_LOCK: "the state directory {directory} is in use by another silo agent ({holder}): one state "
    "directory serves one agent at a time, or the records of what this silo released and spent would be "
    "lost. Stop that agent or wait for it to finish; a separate state_dir would give this silo a separate "
    "privacy budget and release ledger",
    AGGREGATOR_LOCK: "the data directory {directory} is in use by another aggregator ({holder}): one data "
    "directory serves one aggregator, or the two would split the silos between them and no round would "
    "complete. Stop that aggregator first",
}


def _lock(fd: int) -> bool:
    """Whether the lock is now ours. A holder in this very process that nothing references any more is
    collected first, so only a live agent counts: an agent whose start failed can linger in a reference cycle
    with its exception's traceback until the collector runs, and the next start in that process must not
    meet it."""
    if _try_lock(fd):
        return True
    if _record(fd).get("pid") != os.getpid():
        return False
    gc.collect()
    return _try_lock(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _record(fd: int) -> dict:
    """What the holder wrote into the lock file; empty if it has not written yet."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _holder(fd: int) -> str:
    record = _record(fd)
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["since"]))
        return f"pid {record['pid']} on {record['host']}, since {since}"
    except (KeyError, TypeError, ValueError, OverflowError):
        return "which has not written its pid yet"
