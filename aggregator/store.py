"""The aggregator's durable memory in one SQLite file: silos, round attempts, committed states, audit log.

A round becomes real only in `commit_round`, one transaction that stores the new global state, closes the
attempt and appends the audit record; an aggregator killed at any moment restarts from the last committed
round and never loses or repeats one. The audit log is append-only (triggers refuse UPDATE and DELETE) and
chained with HMAC-SHA256 under the aggregator's audit key, so a record removed or edited behind SQLite's back
shows up in `verify_audit`, even when the editor recomputed the chain: that needs the key, not just the file.
Contributions are never stored: only what the operator may show an auditor is. The file holds silo
disclosures, so it and its directory are created readable by the aggregator's user only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from fedlt.aggregation.tail_guard import Census
from fedlt.config import setting
from fedlt.errors import FedltError

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS silos (
    silo_id TEXT PRIMARY KEY, cert_sha256 TEXT NOT NULL, first_seen_ms INTEGER NOT NULL,
    last_seen_ms INTEGER NOT NULL, agent_version TEXT NOT NULL, policy TEXT NOT NULL,
    privacy_remaining REAL
);
CREATE TABLE IF NOT EXISTS attempts (
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, round_id TEXT NOT NULL UNIQUE,
    participants TEXT NOT NULL, started_ms INTEGER NOT NULL, status TEXT NOT NULL,
    ended_ms INTEGER, reason TEXT, PRIMARY KEY (round, attempt)
);
CREATE TABLE IF NOT EXISTS states (
    round INTEGER PRIMARY KEY, digest TEXT NOT NULL, data BLOB NOT NULL, committed_ms INTEGER NOT NULL,
    round_id TEXT, contributors TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (round INTEGER PRIMARY KEY, metrics TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS disclosures (
    silo_id TEXT NOT NULL, name TEXT NOT NULL, round_id TEXT NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (silo_id, name)
);
CREATE TABLE IF NOT EXISTS picks (round INTEGER PRIMARY KEY, silos TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS censuses (phase TEXT PRIMARY KEY, silos TEXT NOT NULL, counts TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    round INTEGER NOT NULL, purpose TEXT NOT NULL, silos TEXT NOT NULL, PRIMARY KEY (round, purpose)
);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL, event TEXT NOT NULL,
    detail TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
"""

DATABASE = "consortium.sqlite"  # in the data directory of each study
GENESIS = "0" * 64
AUTOCHECKPOINT_PAGES = 10_000  # 40 MB of 4 KiB pages: a safety net between the driver's checkpoints
AUDIT_KEY_ID = b"fedlt/audit-key-id/v1"


@dataclass(frozen=True)
class Retention:
    """Which committed states keep their weights (`[retention]` of consortium.toml). Older ones keep their
    round, digest, contributors and metrics, and the audit log keeps every record: a soak of many rounds
    grows the file by those, not by a model a round. A restart needs only the latest state."""

    last: int = setting(3, ge=1, doc="keep the states of the last k rounds")
    every: int = setting(0, ge=0, doc="and of every m-th round (0: none), e.g. checkpoints to go back to")

    def blanked_sql(self) -> tuple[str, tuple[int, ...]]:
        """The WHERE clause (and its values past the round committed) of states to blank now."""
        if self.every:
            return "round <= ? - ? AND round % ? != 0 AND length(data) > 0", (self.last, self.every)
        return "round <= ? - ? AND length(data) > 0", (self.last,)


class StoreError(FedltError):
    """The database belongs to another consortium or is inconsistent."""


@dataclass(frozen=True)
class CommittedState:
    round: int
    digest: str
    data: bytes


@dataclass(frozen=True)
class AuditRecord:
    seq: int
    at_ms: int
    event: str
    detail: dict
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class AuditKey:
    """The secret the audit chain is keyed with (`aggregator.server.derive_audit_key`); kept out of reprs."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 32:
            raise ValueError(f"an audit key has at least 32 bytes, not {len(self.secret)}")

    def link(self, prev: str, at_ms: int, event: str, detail_json: str) -> str:
        """A record's hash: HMAC-SHA256 over the previous hash and the record's fields."""
        message = f"{prev}\x1f{at_ms}\x1f{event}\x1f{detail_json}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def key_id(self) -> str:
        """Names the key in the database without revealing it, so a store opened under another is refused."""
        return hmac.new(self.secret, AUDIT_KEY_ID, hashlib.sha256).hexdigest()[:32]


@contextmanager
def transaction(
    db: sqlite3.Connection, lock: contextlib.AbstractContextManager
) -> Iterator[sqlite3.Connection]:
    """One write transaction under `lock`, rolled back if its body raises (the store's and the catalog's)."""
    with lock:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


def now_ms() -> int:
    return int(time.time() * 1000)


class Store:
    """Thread-safe: the gRPC handlers and the round driver share one connection behind a lock.

    The audit chain of a database is keyed under one `AuditKey` for its whole life; opening it under another,
    or opening one from before keyed chains, raises StoreError rather than extend a chain nobody can verify.
    """

    def __init__(self, path: Path, *, audit_key: AuditKey, retention: Retention | None = None) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # SQLite would create the file 0644, and its -wal and -shm companions take the file's mode.
        with suppress(FileExistsError):
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        # committing a state of megabytes would pass SQLite's 4 MB checkpoint threshold inside the commit, on
        # the round's critical path; the driver checkpoints once the next RoundSpec is out (`checkpoint`)
        self._db.execute(f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}")
        self._db.executescript(SCHEMA)
        self._move_old_metrics()
        self._add_reported_epsilon()
        self._lock = threading.RLock()
        self._audit_key = audit_key
        self._retention = retention or Retention()
        try:
            self._adopt_audit_key()
        except StoreError:
            self._db.close()
            raise

    def _move_old_metrics(self) -> None:
        """Databases made before metrics had a table kept them in the states' rows: copied over once."""
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(states)")]
        if "metrics" in columns:
            self._db.execute(
                "INSERT OR IGNORE INTO metrics SELECT round, metrics FROM states WHERE metrics IS NOT NULL"
            )

    def _add_reported_epsilon(self) -> None:
        """Databases made before the ε each silo last reported was kept (for an export of a stopped
        aggregator) get its column once."""
        if "privacy_remaining" not in [row[1] for row in self._db.execute("PRAGMA table_info(silos)")]:
            self._db.execute("ALTER TABLE silos ADD COLUMN privacy_remaining REAL")

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the database file (durability does not depend on it: a committed
        transaction is on disk in the log already)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return transaction(self._db, self._lock)

    def _adopt_audit_key(self) -> None:
        """A new database records which key chains it; an existing one must be chained under this key."""
        with self._transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'audit_key'").fetchone()
            if row is None and db.execute("SELECT 1 FROM audit LIMIT 1").fetchone() is None:
                db.execute("INSERT INTO meta VALUES ('audit_key', ?)", (self._audit_key.key_id(),))
                return
        if row is None:
            raise StoreError(
                "this database's audit log was chained without a key, so a copy of the file could have "
                "rewritten it; keep it for the record and use a new data_dir"
            )
        if row[0] != self._audit_key.key_id():
            raise StoreError(
                "this database's audit log is chained under another key than the one derived from "
                "server.key; was the aggregator's key replaced? Use the key the run started with"
            )

    # --- identity of the run ---------------------------------------------------------------------

    def bind(self, fingerprint: str) -> bool:
        """Tie the database to one consortium configuration; True when it is new."""
        with self._transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('fingerprint', ?)", (fingerprint,))
                return True
        if row[0] != fingerprint:
            raise StoreError(
                "this data directory holds a consortium run with other settings; "
                "use a new data_dir for a new run (a run an earlier fedlt version started resumes only "
                "under that version: docs/deploy.md, Upgrades)"
            )
        return False

    # --- silos ------------------------------------------------------------------------------------

    def register_silo(self, silo_id: str, cert_sha256: str, agent_version: str, policy: dict) -> None:
        at = now_ms()
        with self._transaction() as db:
            known = db.execute("SELECT cert_sha256 FROM silos WHERE silo_id = ?", (silo_id,)).fetchone()
            db.execute(
                "INSERT INTO silos (silo_id, cert_sha256, first_seen_ms, last_seen_ms, agent_version, "
                "policy) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(silo_id) DO UPDATE SET "
                "cert_sha256 = excluded.cert_sha256, last_seen_ms = excluded.last_seen_ms, "
                "agent_version = excluded.agent_version, policy = excluded.policy",
                (silo_id, cert_sha256, at, at, agent_version, json.dumps(policy, sort_keys=True)),
            )
            if known is None or known[0] != cert_sha256:
                event = "silo_enrolled" if known is None else "silo_certificate_changed"
                self._audit(db, event, {"silo": silo_id, "cert_sha256": cert_sha256})

    def touch_silo(self, silo_id: str, privacy_remaining: float | None = None) -> None:
        """A heartbeat: when it was, and the ε left the silo reported in it (None: it reports none)."""
        with self._lock:
            self._db.execute(
                "UPDATE silos SET last_seen_ms = ?, privacy_remaining = ? WHERE silo_id = ?",
                (now_ms(), privacy_remaining, silo_id),
            )

    def policy(self, silo_id: str) -> dict:
        """What the silo said its policy accepts when it last registered."""
        with self._lock:
            row = self._db.execute("SELECT policy FROM silos WHERE silo_id = ?", (silo_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def silos(self) -> dict[str, int]:
        """Registered silo ids and when each was last seen."""
        with self._lock:
            return dict(self._db.execute("SELECT silo_id, last_seen_ms FROM silos ORDER BY silo_id"))

    # --- rounds -----------------------------------------------------------------------------------

    def latest_state(self) -> CommittedState | None:
        with self._lock:
            row = self._db.execute(
                "SELECT round, digest, data FROM states ORDER BY round DESC LIMIT 1"
            ).fetchone()
        return CommittedState(*row) if row else None

    def metrics_history(self) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT metrics FROM metrics ORDER BY round").fetchall()
        return [json.loads(r[0]) for r in rows]

    def save_initial_state(self, digest: str, data: bytes) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO states (round, digest, data, committed_ms, round_id, contributors) "
                "VALUES (0, ?, ?, ?, NULL, '[]')",
                (digest, data, now_ms()),
            )
            self._audit(db, "initial_state", {"digest": digest, "bytes": len(data)})

    def abandon_open_attempts(self, reason: str) -> list[str]:
        """Close attempts left open by a crash; their round is simply run again."""
        with self._transaction() as db:
            open_ids = [r[0] for r in db.execute("SELECT round_id FROM attempts WHERE status = 'open'")]
            for round_id in open_ids:
                self._close_attempt(db, round_id, "abandoned", reason)
        return open_ids

    def begin_attempt(self, round_number: int, participants: list[str], nonce: str) -> tuple[int, str]:
        with self._transaction() as db:
            (last,) = db.execute(
                "SELECT COALESCE(MAX(attempt), 0) FROM attempts WHERE round = ?", (round_number,)
            ).fetchone()
            attempt = last + 1
            round_id = f"r{round_number}.a{attempt}.{nonce}"
            db.execute(
                "INSERT INTO attempts VALUES (?, ?, ?, ?, ?, 'open', NULL, NULL)",
                (round_number, attempt, round_id, json.dumps(participants), now_ms()),
            )
            self._audit(db, "attempt_started", {"round_id": round_id, "participants": participants})
        return attempt, round_id

    def attempt_statuses(self) -> list[str]:
        """Every attempt's status, in the order they began."""
        with self._lock:
            rows = self._db.execute("SELECT status FROM attempts ORDER BY round, attempt").fetchall()
        return [status for (status,) in rows]

    def abort_attempt(self, round_id: str, reason: str) -> None:
        with self._transaction() as db:
            self._close_attempt(db, round_id, "aborted", reason)

    def record_contribution(self, round_id: str, silo_id: str, sha256: str) -> None:
        with self._transaction() as db:
            self._audit(
                db, "contribution_accepted", {"round_id": round_id, "silo": silo_id, "sha256": sha256}
            )

    def record_refusal(self, round_id: str, silo_id: str, code: str, text: str) -> None:
        """A silo's refusal of an attempt, in the words it sent (which name no fact of its data)."""
        with self._transaction() as db:
            self._audit(
                db, "round_refused", {"round_id": round_id, "silo": silo_id, "code": code, "text": text}
            )

    def last_picked(self) -> dict[str, int]:
        """The last committed training round each silo was picked for (closing rounds invite everyone)."""
        with self._lock:
            rows = self._db.execute("SELECT round, silos FROM picks ORDER BY round").fetchall()
        return {silo: r for r, silos in rows for silo in json.loads(silos)}

    # --- the survivor sets silos are asked to release a round's sums for (silo.releases) --------------

    def pin_release(self, round_number: int, purpose: str, silos: Collection[str]) -> None:
        """Kept before any silo is asked to release the round's `purpose` sum for `silos`: each silo signs one
        survivor set a round and refuses any other, so every later attempt of the round, after a restart
        too, must run over this set. The first set kept stays."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO releases VALUES (?, ?, ?)",
                (round_number, purpose, json.dumps(sorted(silos))),
            )

    def pinned_releases(self, round_number: int) -> dict[str, list[str]]:
        """The survivor set kept for each sum of the round (by purpose) that silos were asked to release."""
        with self._lock:
            rows = self._db.execute(
                "SELECT purpose, silos FROM releases WHERE round = ?", (round_number,)
            ).fetchall()
        return {purpose: json.loads(silos) for purpose, silos in rows}

    # --- the census of each phase: taken once, over one set of silos (fedlt.aggregation.tail_guard) ---

    def census(self, phase: str) -> Census | None:
        with self._lock:
            row = self._db.execute("SELECT silos, counts FROM censuses WHERE phase = ?", (phase,)).fetchone()
        if row is None:
            return None
        counts = json.loads(row[1])  # a list; with a record floor, {"counts": [...], "records": [...]}
        if isinstance(counts, dict):
            return Census.of(json.loads(row[0]), counts["counts"], counts["records"])
        return Census.of(json.loads(row[0]), counts)

    def save_census(self, phase: str, census: Census) -> None:
        """Kept for the phase as soon as it is taken, committed round or not: silos release their presence to
        one set of silos, so a restarted aggregator must ask for rounds over this one, not take another. The
        census taken again over the same silos (after silos refused one they had not kept) replaces it; the
        audit log names a census once, unless it changed."""
        row = (json.dumps(list(census.silos)), json.dumps(_counts_of(census)))
        with self._transaction() as db:
            kept = db.execute("SELECT silos, counts FROM censuses WHERE phase = ?", (phase,)).fetchone()
            db.execute("INSERT OR REPLACE INTO censuses VALUES (?, ?, ?)", (phase, *row))
            if kept is None or tuple(kept) != row:
                self._audit(db, "census_taken", {"phase": phase, "silos": list(census.silos)})

    # --- disclosures: per-silo values a consortium has agreed to (not sums), latest one per silo --------

    def disclosures(self, name: str) -> dict[str, bytes]:
        with self._lock:
            rows = self._db.execute("SELECT silo_id, data FROM disclosures WHERE name = ?", (name,))
            return dict(rows.fetchall())

    def commit_round(
        self,
        *,
        round_number: int,
        round_id: str,
        digest: str,
        data: bytes,
        contributors: list[str],
        picked: list[str] | None = None,
        disclosures: Mapping[str, tuple[str, bytes]] | None = None,
    ) -> None:
        """One transaction: the state, the silos picked to train, and the disclosures the round collected
        (name, values per silo; only a committed round's are kept, each silo's latest per name)."""
        with self._transaction() as db:
            (latest,) = db.execute("SELECT COALESCE(MAX(round), -1) FROM states").fetchone()
            if latest != round_number - 1:
                raise StoreError(f"cannot commit round {round_number} on top of round {latest}")
            db.execute(
                "INSERT INTO states (round, digest, data, committed_ms, round_id, contributors) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (round_number, digest, data, now_ms(), round_id, json.dumps(contributors)),
            )
            where, values = self._retention.blanked_sql()
            db.execute(f"UPDATE states SET data = x'' WHERE {where}", (round_number, *values))
            if picked is not None:
                db.execute("INSERT INTO picks VALUES (?, ?)", (round_number, json.dumps(sorted(picked))))
            db.executemany(
                "INSERT OR REPLACE INTO disclosures VALUES (?, ?, ?, ?)",
                [(silo, name, round_id, values) for silo, (name, values) in (disclosures or {}).items()],
            )
            self._close_attempt(db, round_id, "committed", None)
            self._audit(
                db,
                "round_committed",
                {"round": round_number, "round_id": round_id, "digest": digest, "contributors": contributors},
            )

    def save_metrics(self, round_number: int, metrics: dict) -> None:
        """In a table of their own: updating the state's row would rewrite its megabytes of weights."""
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO metrics VALUES (?, ?)", (round_number, json.dumps(metrics)))

    def _close_attempt(self, db: sqlite3.Connection, round_id: str, status: str, reason: str | None) -> None:
        db.execute(
            "UPDATE attempts SET status = ?, ended_ms = ?, reason = ? WHERE round_id = ? AND status = 'open'",
            (status, now_ms(), reason, round_id),
        )
        if status != "committed":
            self._audit(db, f"attempt_{status}", {"round_id": round_id, "reason": reason})

    # --- audit ------------------------------------------------------------------------------------

    def audit(self, event: str, detail: dict) -> None:
        with self._transaction() as db:
            self._audit(db, event, detail)

    def _audit(self, db: sqlite3.Connection, event: str, detail: dict) -> None:
        row = db.execute("SELECT hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        prev = row[0] if row else GENESIS
        at = now_ms()
        text = json.dumps(detail, sort_keys=True)
        db.execute(
            "INSERT INTO audit (at_ms, event, detail, prev_hash, hash) VALUES (?, ?, ?, ?, ?)",
            (at, event, text, prev, self._audit_key.link(prev, at, event, text)),
        )

    def audit_log(self) -> list[AuditRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM audit ORDER BY seq").fetchall()
        return [AuditRecord(s, at, e, json.loads(d), p, h) for s, at, e, d, p, h in rows]

    def verify_audit(self) -> None:
        """Raise StoreError at the first record whose chain link or keyed hash is wrong."""
        prev = GENESIS
        for rec in self.audit_log():
            text = json.dumps(rec.detail, sort_keys=True)
            expected = self._audit_key.link(prev, rec.at_ms, rec.event, text)
            if rec.prev_hash != prev or not hmac.compare_digest(rec.hash, expected):
                raise StoreError(f"audit record {rec.seq} ({rec.event}) does not match the hash chain")
            prev = rec.hash


def _counts_of(census: Census) -> list[int] | dict[str, list[int]]:
    """What the censuses table keeps of a census's sums (the list alone where there is no record floor)."""
    if not census.records:
        return list(census.counts)
    return {"counts": list(census.counts), "records": list(census.records)}
