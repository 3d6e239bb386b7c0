"""The aggregator's studies, in one SQLite file beside the default study's store (`studies.sqlite`).

A study is a plan the consortium runs: its own method, layer, state, retention and audit chain. The catalog
holds each study's id, the text of its study file, where it stands and why, and the order it was created in
(the queue). The default study, the one consortium.toml defines, keeps the data directory's own store, as a
single run did before studies existed; every study created with `python -m aggregator study create` has a
folder of its own, `studies/<id>/`. A data directory without a catalog is a single run's: opening it makes
the catalog and enters that run as the default study, which goes on from its last committed round.

States: `queued` (waits for a free slot, `[server] max_studies`), `running`, `paused` (by the operator; its
silos wait), `done` (every round committed), `cancelled` (by the operator, for good), `failed` (stopped on an
error; `resume` tries again).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aggregator.store import now_ms, transaction
from fedlt.errors import FedltError

CATALOG = "studies.sqlite"
STUDIES = "studies"  # the folder of created studies' own data directories
STATES = ("queued", "running", "paused", "done", "cancelled", "failed")
# what the operator may do from each state
PAUSABLE = ("queued", "running")
RESUMABLE = ("paused", "failed")
CANCELLABLE = ("queued", "running", "paused", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    position INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, study_toml TEXT NOT NULL,
    state TEXT NOT NULL, reason TEXT NOT NULL, created_ms INTEGER NOT NULL, changed_ms INTEGER NOT NULL,
    is_default INTEGER NOT NULL, progress TEXT NOT NULL
);
"""


class StudyError(FedltError):
    """An operator's request about a study that cannot be done as asked (the message says why)."""


class UnknownStudy(StudyError):
    """No study of that id."""


class StudyExists(StudyError):
    """A study of that id exists already (ids are never reused: a cancelled study keeps its audit chain)."""


class BadStudy(StudyError):
    """A study file with problems; `problems` lists each, as a config file's are."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("the study file has problems:\n  " + "\n  ".join(problems))
        self.problems = problems


class WrongState(StudyError):
    """The study is not in a state the request applies to (resume a running study, cancel a done one)."""


@dataclass(frozen=True)
class StudyInfo:
    """One study as the catalog and its run know it: `progress` holds what the operator's list shows of a
    study that is not running (rounds committed, the state's digest), kept when its run stops."""

    id: str
    state: str
    reason: str
    position: int
    created_ms: int
    changed_ms: int
    is_default: bool
    method: str = ""
    privacy: str = ""
    committed_rounds: int = 0
    total_rounds: int = 0
    state_digest: str = ""
    dp_enabled: bool = False
    queue_position: int = 0  # 1 for the next queued study to start; 0 when not queued


class Catalog:
    """Thread-safe; every change is one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return transaction(self._db, self._lock)

    def add(self, study: str, study_toml: str, *, is_default: bool = False, state: str = "queued") -> None:
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM studies WHERE id = ?", (study,)).fetchone():
                raise StudyExists(f"a study {study!r} exists already; ids are never reused")
            at = now_ms()
            db.execute(
                "INSERT INTO studies (id, study_toml, state, reason, created_ms, changed_ms, is_default, "
                "progress) VALUES (?, ?, ?, '', ?, ?, ?, '{}')",
                (study, study_toml, state, at, at, int(is_default)),
            )

    def set_state(
        self, study: str, state: str, reason: str = "", *, allowed: tuple[str, ...] = STATES
    ) -> str:
        """Move `study` to `state` if it is in one of `allowed`; the state it was in."""
        with self._transaction() as db:
            row = db.execute("SELECT state FROM studies WHERE id = ?", (study,)).fetchone()
            if row is None:
                raise UnknownStudy(f"no study {study!r} on this aggregator")
            if row[0] not in allowed:
                raise WrongState(f"study {study!r} is {row[0]}")
            db.execute(
                "UPDATE studies SET state = ?, reason = ?, changed_ms = ? WHERE id = ?",
                (state, reason, now_ms(), study),
            )
            return row[0]

    def keep_progress(self, study: str, progress: dict) -> None:
        with self._transaction() as db:
            db.execute("UPDATE studies SET progress = ? WHERE id = ?", (json.dumps(progress), study))

    def study_toml(self, study: str) -> str:
        with self._lock:
            row = self._db.execute("SELECT study_toml FROM studies WHERE id = ?", (study,)).fetchone()
        if row is None:
            raise UnknownStudy(f"no study {study!r} on this aggregator")
        return row[0]

    def default(self) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT id FROM studies WHERE is_default = 1").fetchone()
        return None if row is None else row[0]

    def studies(self) -> list[StudyInfo]:
        """Every study, in the order they were created; queued ones numbered in the order they will start."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, state, reason, position, created_ms, changed_ms, is_default, progress "
                "FROM studies ORDER BY position"
            ).fetchall()
        found, queued = [], 0
        for study, state, reason, position, created, changed, is_default, progress in rows:
            queued += state == "queued"
            found.append(
                StudyInfo(
                    study,
                    state,
                    reason,
                    position,
                    created,
                    changed,
                    bool(is_default),
                    queue_position=queued if state == "queued" else 0,
                    **json.loads(progress),
                )
            )
        return found

    def info(self, study: str) -> StudyInfo:
        for found in self.studies():
            if found.id == study:
                return found
        raise UnknownStudy(f"no study {study!r} on this aggregator")


def study_text(data_dir: Path, study: str) -> str | None:
    """A study's file as the catalog keeps it, read without writing (the aggregator may be running); None
    for the default study, whose file is consortium.toml. `UnknownStudy` if the catalog has no such study."""
    path = data_dir / CATALOG
    if not path.exists():
        raise UnknownStudy(f"{data_dir} has no studies ({CATALOG} is missing): leave out the study")
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT study_toml, is_default FROM studies WHERE id = ?", (study,)).fetchone()
    finally:
        db.close()
    if row is None:
        raise UnknownStudy(f"no study {study!r} in {data_dir}")
    return None if row[1] else row[0]


class StudyControl(Protocol):
    """What the operator's commands ask of the aggregator's studies (`aggregator.studies.Studies`); `by` is
    the operator certificate's name, written to the study's audit log with the change."""

    def create(self, study: str, study_toml: str, *, by: str) -> StudyInfo: ...

    def list(self) -> list[StudyInfo]: ...

    def pause(self, study: str, *, by: str) -> StudyInfo: ...

    def resume(self, study: str, *, by: str) -> StudyInfo: ...

    def cancel(self, study: str, *, by: str, reason: str) -> StudyInfo: ...

    def status(self, study: str) -> dict:
        """The study's round table as `aggregator.inbox.RoundInbox.status` gives it; for a study that is not
        running, its last committed round and digest with no round in flight and its registered silos."""
        ...
