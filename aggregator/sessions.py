"""The silos connected right now: one open Join stream each, its directive queue, its last heartbeat.

The round driver waits on the condition this registry shares with the round table, so a connect, a
disconnect or a message wakes it. The directives themselves (RoundSpec, a sum's step, abort, finished) are
made here, in their Protobuf form, so the driver deals in rounds and sums, not in messages.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from aggregator.store import now_ms
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.wire import step_to_pb

log = logging.getLogger("aggregator")


@dataclass
class Session:
    """One open Join stream; a reconnecting silo replaces its older session."""

    silo_id: str
    directives: queue.Queue = field(default_factory=queue.Queue)
    activity: str = "idle"
    last_seen_ms: int = field(default_factory=now_ms)
    closed: bool = False
    privacy_remaining: float | None = None  # only if the silo reports it


# A silo that replaces a session still open this often within a minute is likely two agents under one
# certificate, each taking the silo's place from the other (a reconnect replaces one now and then).
TAKEOVERS, TAKEOVER_WINDOW_MS = 3, 60_000


class Sessions:
    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._open: dict[str, Session] = {}
        self._takeovers: dict[str, list[int]] = {}

    def open(self, silo_id: str) -> Session:
        """A new session for `silo_id`, ending the one it replaces (call with the lock held)."""
        old = self._open.get(silo_id)
        if old is not None:
            old.closed = True
            old.directives.put(None)
            self._took_over(silo_id)
        session = self._open[silo_id] = Session(silo_id)
        self._lock.notify_all()
        return session

    def _took_over(self, silo_id: str) -> None:
        """Say so when a silo keeps replacing its own open session: two agents of one silo (each with its own
        state directory, so neither stops the other) would stall every round, and nothing else tells."""
        now = now_ms()
        recent = [t for t in self._takeovers.get(silo_id, []) if now - t < TAKEOVER_WINDOW_MS] + [now]
        self._takeovers[silo_id] = recent
        if len(recent) == TAKEOVERS:
            log.warning(
                "%s connected %d times within a minute while its session was open: are two agents running "
                "with its certificate? Each takes the silo's place from the other and no round completes; "
                "stop all but one (one agent, one state directory per silo)",
                silo_id,
                TAKEOVERS,
            )

    def close(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            if self._open.get(session.silo_id) is session:
                del self._open[session.silo_id]
            self._lock.notify_all()

    def heartbeat(self, silo_id: str, activity: str, privacy_remaining: float | None = None) -> None:
        with self._lock:
            session = self._open.get(silo_id)
            if session is not None:
                session.activity = activity
                session.last_seen_ms = now_ms()
                session.privacy_remaining = privacy_remaining

    def connected(self) -> set[str]:
        return set(self._open)

    def current(self, silo_id: str) -> Session | None:
        """The silo's open session: a refusal made on another one no longer stands."""
        return self._open.get(silo_id)

    def round_spec(self, silos: Iterable[str], signed: round_pb2.SignedRoundSpec) -> None:
        self._send(silos, pb.JoinResponse(round_spec=signed))

    def step(self, silo: str, round_id: str, purpose: str, step: object) -> None:
        """One stage output of a sum (any layer's; `privacy.wire` knows its Protobuf form)."""
        self._send([silo], pb.JoinResponse(sum_step=step_to_pb(round_id, purpose, step)))

    def abort(self, silos: Iterable[str], round_id: str, reason: str) -> None:
        self._send(silos, pb.JoinResponse(abort=pb.Abort(round_id=round_id, reason=reason)))

    def finished(self, silos: Iterable[str], rounds: int, state_digest: str) -> None:
        self._send(silos, pb.JoinResponse(finished=pb.Finished(rounds=rounds, state_digest=state_digest)))

    def _send(self, silos: Iterable[str], directive: pb.JoinResponse) -> None:
        """Queue `directive` for each of `silos` that is connected (the others get it when they rejoin)."""
        with self._lock:
            for silo in silos:
                if silo in self._open:
                    self._open[silo].directives.put(directive)

    def describe(self, silo_id: str, last_seen_ms: int) -> dict:
        session = self._open.get(silo_id)
        described = {
            "connected": session is not None,
            "last_seen_unix_ms": session.last_seen_ms if session else last_seen_ms,
            "activity": session.activity if session else "offline",
        }
        if session is not None and session.privacy_remaining is not None:
            described["privacy_remaining"] = session.privacy_remaining
        return described
