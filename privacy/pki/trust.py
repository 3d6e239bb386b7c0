"""Whom a party accepts as a consortium member: issued by the CA, valid now, not revoked, named by the roster.

All four questions are asked at every use. Parsing a certificate and checking the CA's signature on it are
cached (they cannot change); validity dates, the revocation list and the roster can, so they are not.
"""

from __future__ import annotations

import threading
from typing import Protocol

from cryptography import x509

from privacy.pki.errors import PkiError
from privacy.pki.identity import (
    check_issued_by,
    check_valid_now,
    describe,
    load_certificate,
    silo_id_of,
)
from privacy.pki.roster import AGGREGATOR, SILO, Member, Revocations, Roster


class Rosters(Protocol):
    """Where the roster in force comes from: a fixed `Roster`, a silo's pinned one, the aggregator's file."""

    def current(self) -> Roster: ...


class RevokedSerials:
    """The union of every valid CRL seen: revocations are never undone, so an older CRL cannot unrevoke."""

    def __init__(self, serials: frozenset[int] = frozenset()) -> None:
        self._serials = frozenset(serials)
        self._lock = threading.Lock()

    def add(self, serials: frozenset[int]) -> bool:
        """True when `serials` revoked something new."""
        with self._lock:
            merged = self._serials | serials
            news = merged != self._serials
            self._serials = merged
            return news

    @property
    def serials(self) -> frozenset[int]:
        return self._serials

    def is_revoked(self, cert: x509.Certificate) -> bool:
        return cert.serial_number in self._serials


class MemberTrust:
    def __init__(self, ca_pem: bytes, rosters: Rosters, revocations: Revocations) -> None:
        self.ca = load_certificate(ca_pem, source="the consortium CA certificate")
        self.rosters = rosters
        self.revocations = revocations
        self._issued: dict[bytes, x509.Certificate] = {}
        self._lock = threading.Lock()

    def silo(self, pem: bytes, silo_id: str) -> x509.Certificate:
        """The certificate of silo `silo_id`, or PkiError saying why not."""
        cert, _ = self._member(pem, SILO, silo_id)
        if silo_id_of(cert) != silo_id:
            raise PkiError(f"the certificate sent for {silo_id} belongs to {silo_id_of(cert)}")
        return cert

    def aggregator(self, pem: bytes) -> x509.Certificate:
        """The certificate of the roster's aggregator (its TLS endpoint and RoundSpec signer)."""
        return self._member(pem, AGGREGATOR, None)[0]

    def _member(self, pem: bytes, role: str, member_id: str | None) -> tuple[x509.Certificate, Member]:
        cert = self._issued_certificate(pem)
        check_valid_now(cert)
        if self.revocations.is_revoked(cert):
            raise PkiError(f"{describe(cert)} has been revoked by the consortium CA")
        return cert, self.rosters.current().member_of(cert, role=role, member_id=member_id)

    def _issued_certificate(self, pem: bytes) -> x509.Certificate:
        with self._lock:
            cert = self._issued.get(pem)
        if cert is None:
            cert = load_certificate(pem, source="a member's certificate")
            check_issued_by(cert, self.ca)
            with self._lock:
                self._issued[pem] = cert
        return cert
