"""The aggregator's part in the CKKS key ceremony: keep what silos announce, relay what the key holder seals.

The aggregator opens nothing here: it keeps each silo's signed enrollment key (checked by the key holder, not
by the aggregator) with the certificate the silo registered with, the public context (all it needs to add
ciphertexts), and one sealed envelope per silo for the current key. A silo is `eligible` for a ckks round once
an envelope addressed to it is here (the key holder always is). A new key from the key holder (rotation)
replaces the envelopes of the old one. Kept in memory: an aggregator restarted loses it until the key holder
registers again and shares once more.
"""

from __future__ import annotations

import threading

from fedlt.aggregation.halves import BadMessage, SumAborted
from privacy.ckks.ceremony import Announcement, SealedContext
from privacy.ckks.keys import CkksKeyError, PublicContext


class NoKeyYet(SumAborted):
    """The key holder has not shared the consortium's key (with this silo) yet."""


class CkksRelay:
    def __init__(self, key_holder: str) -> None:
        self.key_holder = key_holder
        self._lock = threading.Lock()
        self._enrollments: dict[str, Announcement] = {}
        self._sealed: dict[str, SealedContext] = {}  # recipient -> envelope of the current key
        self._holder_certificate = b""
        self.context_id = ""
        self.public: PublicContext | None = None

    def enroll(self, announcement: Announcement) -> None:
        with self._lock:
            self._enrollments[announcement.silo] = announcement

    def certificate(self, silo: str) -> bytes:
        """The certificate `silo` enrolled with (b"" if none): relayed beside its consistency signatures,
        which every silo checks against its roster (the Consistency RPC carries the signature alone)."""
        with self._lock:
            enrolled = self._enrollments.get(silo)
        return b"" if enrolled is None else enrolled.certificate

    def enrollments(self) -> list[Announcement]:
        with self._lock:
            return sorted(self._enrollments.values(), key=lambda a: a.silo)

    def share(
        self, sender: str, certificate: bytes, context_id: str, public: bytes, sealed: list[SealedContext]
    ) -> None:
        """Take the key holder's public context and envelopes (a new context id replaces the old key)."""
        if sender != self.key_holder:
            raise BadMessage(
                f"{sender} is not the consortium's CKKS key holder ({self.key_holder or 'none'})"
            )
        if not context_id:
            raise BadMessage("a shared CKKS key names its context id")
        wrong = [s.recipient for s in sealed if s.sender != sender or s.context_id != context_id]
        if wrong:
            raise BadMessage(f"envelopes for {', '.join(wrong)} are not of this key or this sender")
        try:
            context = PublicContext.from_bytes(public)
        except CkksKeyError as exc:
            raise BadMessage(f"the public context: {exc}") from None
        with self._lock:
            if context_id != self.context_id:
                self._sealed.clear()
            self.context_id, self.public, self._holder_certificate = context_id, context, certificate
            self._sealed.update({s.recipient: s for s in sealed})

    def fetch(self, silo: str, context_id: str) -> tuple[SealedContext, bytes]:
        """The envelope addressed to `silo` for key `context_id`, and the key holder's certificate."""
        with self._lock:
            envelope = self._sealed.get(silo)
            if context_id != self.context_id or envelope is None:
                raise NoKeyYet(f"no CKKS key {context_id[:16]} sealed to {silo} (yet)")
            return envelope, self._holder_certificate

    def eligible(self, silo: str) -> bool:
        with self._lock:
            return self.public is not None and (silo == self.key_holder or silo in self._sealed)
