"""The aggregator's part in the key service: keep what silos announce, relay what the key holder seals.

Built only where the consortium's layer asks for a key service (`LayerRecord.key_service`); the layer's
aggregator side reads it as a `privacy.keyservice.relay.KeyRelay`. The aggregator opens nothing here: it keeps
each silo's signed enrollment key (checked by the key holder, not by the aggregator) with the certificate the
silo registered with, the key's public part (read with the layer's `KeyKind.read_public`: all it needs to add
what silos encrypt), and one sealed envelope per silo for the current key. A silo is `eligible` for a round
once an envelope addressed to it is here (the key holder always is). A new key from the key holder (rotation)
replaces the envelopes of the old one. Kept in memory: an aggregator restarted loses it until the key holder
registers again and shares once more.
"""

from __future__ import annotations

import threading

from fedlt.aggregation.halves import BadMessage
from fedlt.aggregation.registry import KeyKind, LayerRecord
from fedlt.errors import FedltError
from privacy.keyservice.ceremony import Announcement, SealedContext
from privacy.keyservice.relay import NoKeyYet


class NoKeyService(FedltError):
    """A key-service call where the consortium's layer asks for none."""


class KeyServiceRelay:
    def __init__(self, layer: str, kind: KeyKind, key_holder: str) -> None:
        self.layer, self.key_holder = layer, key_holder
        self._read_public = kind.read_public
        self._lock = threading.Lock()
        self._enrollments: dict[str, Announcement] = {}
        self._sealed: dict[str, SealedContext] = {}  # recipient -> envelope of the current key
        self._holder_certificate = b""
        self.context_id = ""
        self.public: object | None = None

    @classmethod
    def for_layer(cls, record: LayerRecord, settings: object) -> KeyServiceRelay | None:
        """The relay of the consortium's layer, None if it asks for no key service; its key holder is the
        one its settings name (`key_holder`, as `KeyKind` says)."""
        if record.key_service is None:
            return None
        return cls(record.name, record.key_service, settings.key_holder)

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
        """Take the key holder's public part and envelopes (a new context id replaces the old key)."""
        if sender != self.key_holder:
            raise BadMessage(
                f"{sender} is not the consortium's {self.layer} key holder ({self.key_holder or 'none'})"
            )
        if not context_id:
            raise BadMessage(f"a shared {self.layer} key names its context id")
        wrong = [s.recipient for s in sealed if s.sender != sender or s.context_id != context_id]
        if wrong:
            raise BadMessage(f"envelopes for {', '.join(wrong)} are not of this key or this sender")
        try:
            key = self._read_public(public)
        except ValueError as exc:
            raise BadMessage(f"the public part of the {self.layer} key: {exc}") from None
        with self._lock:
            if context_id != self.context_id:
                self._sealed.clear()
            self.context_id, self.public, self._holder_certificate = context_id, key, certificate
            self._sealed.update({s.recipient: s for s in sealed})

    def fetch(self, silo: str, context_id: str) -> tuple[SealedContext, bytes]:
        """The envelope addressed to `silo` for key `context_id`, and the key holder's certificate."""
        with self._lock:
            envelope = self._sealed.get(silo)
            if context_id != self.context_id or envelope is None:
                raise NoKeyYet(f"no {self.layer} key {context_id[:16]} sealed to {silo} (yet)")
            return envelope, self._holder_certificate

    def eligible(self, silo: str) -> bool:
        with self._lock:
            return self.public is not None and (silo == self.key_holder or silo in self._sealed)
