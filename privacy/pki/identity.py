"""What the aggregator and the silos check about a peer: who it is, who issued it, whether it is revoked, and
whether the consortium accepts it as a member.

TLS checks the chain of a connection's peer but knows nothing of consortium identities or of the CRL, so a
handler reads the identity here (from the certificate, never from a message) and asks the revocation list.
Certificates that arrive inside messages (the aggregator's signing certificate) get `verify_chain` as well.

Whom a party accepts as a consortium member (`MemberTrust`): issued by the CA, valid now, not revoked, named
by the roster. All four questions are asked at every use. Parsing a certificate and checking the CA's
signature on it are cached (they cannot change); validity dates, the revocation list and the roster can, so
they are not.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from privacy.pki.errors import PkiError

if TYPE_CHECKING:  # the roster reads its certificates with this module: only its types come back here
    from privacy.pki.roster import Member, Revocations, Roster

SILO = "silo"  # a roster role, and the kind of a silo's client certificate (`identity_uri`)
AGGREGATOR = "aggregator"  # a roster role: the TLS endpoint and RoundSpec signer
OPERATOR = "operator"  # the kind of an operator's client certificate
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ID_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_URI_SCHEME = "fedlt://"
_Ext = TypeVar("_Ext", bound=x509.ExtensionType)


def identity_uri(kind: str, name: str) -> str:
    """The URI SAN that names a consortium member: `fedlt://silo/<id>` or `fedlt://operator/<name>`."""
    return f"{_URI_SCHEME}{kind}/{name}"


def check_id(kind: str, name: str) -> str:
    """Ids become file names and URI paths, hence the narrow alphabet."""
    if not ID_PATTERN.fullmatch(name):
        raise PkiError(f"invalid {kind} id {name!r}: use {ID_RULE}")
    return name


def format_utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def describe(cert: x509.Certificate) -> str:
    return f"certificate {cert.subject.rfc4514_string() or '(no subject)'} (serial {cert.serial_number:x})"


def load_certificate(pem: bytes, *, source: str = "the data") -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise PkiError(f"{source} is not a PEM certificate: {exc}") from None


def read_certificate(path: str | os.PathLike[str]) -> x509.Certificate:
    return load_certificate(_read(Path(path), "certificate"), source=str(path))


def silo_id_of(cert: x509.Certificate) -> str:
    """The `fedlt://silo/<id>` URI SAN; the CN counts only without any fedlt URI, so no operator passes."""
    return _member_of(cert, SILO, cn_fallback=True)


def operator_name_of(cert: x509.Certificate) -> str:
    """Only the `fedlt://operator/<name>` URI SAN makes an operator: no fallback grants that privilege."""
    return _member_of(cert, OPERATOR, cn_fallback=False)


def _member_of(cert: x509.Certificate, kind: str, *, cn_fallback: bool) -> str:
    usages = _extension(cert, x509.ExtendedKeyUsage)
    if usages is None or ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        raise PkiError(f"{describe(cert)} is not a client certificate (no clientAuth extended key usage)")
    sans = _extension(cert, x509.SubjectAlternativeName)
    uris = [] if sans is None else sans.get_values_for_type(x509.UniformResourceIdentifier)
    ours = [uri for uri in uris if uri.startswith(_URI_SCHEME)]
    prefix = identity_uri(kind, "")
    names = [uri.removeprefix(prefix) for uri in ours if uri.startswith(prefix)]
    if len(names) > 1:
        raise PkiError(f"{describe(cert)} names more than one {kind}: {', '.join(names)}")
    if names:
        return check_id(kind, names[0])
    if ours:
        raise PkiError(
            f"{describe(cert)} names {ours[0]}, but {kind} certificates name {identity_uri(kind, '<id>')}"
        )
    common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME) if cn_fallback else []
    if common_names:
        return check_id(kind, str(common_names[0].value))
    raise PkiError(f"{describe(cert)} names no {kind}: it has no {identity_uri(kind, '<id>')} URI")


def verify_chain(cert: x509.Certificate, ca_cert: x509.Certificate) -> None:
    """Issued by the consortium CA and valid now (consortium certificates have no intermediates)."""
    check_issued_by(cert, ca_cert)
    check_valid_now(cert)


def check_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> None:
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise PkiError(f"{describe(cert)} was not issued by the consortium CA {describe(ca_cert)}") from None


def check_valid_now(cert: x509.Certificate) -> None:
    """Validity is a question of the moment, so it is asked at every use, never cached."""
    now = datetime.now(UTC)
    if now < cert.not_valid_before_utc:
        raise PkiError(
            f"{describe(cert)} is not yet valid: valid from {format_utc(cert.not_valid_before_utc)}"
        )
    if now > cert.not_valid_after_utc:
        raise PkiError(f"{describe(cert)} expired on {format_utc(cert.not_valid_after_utc)}")


class RevocationList:
    """The revoked serials of the consortium CA's CRL, re-read whenever the file changes.

    `reload` is cheap when nothing changed (one stat), so the aggregator calls it before every check and a
    revocation takes effect on the next call. A CRL that cannot be read or does not verify raises instead of
    counting as empty: failing open would readmit every revoked member.
    """

    def __init__(self, ca_cert: x509.Certificate, crl_path: str | os.PathLike[str]) -> None:
        self.ca_cert = ca_cert
        self.crl_path = Path(crl_path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._revoked: frozenset[int] = frozenset()
        self._pem, self._sha256 = b"", ""
        self.reload()

    @classmethod
    def load(
        cls, ca_pem_path: str | os.PathLike[str], crl_pem_path: str | os.PathLike[str]
    ) -> RevocationList:
        return cls(read_certificate(ca_pem_path), crl_pem_path)

    def reload(self) -> None:
        """Re-read the CRL if it was modified or replaced; the CA rewrites it by rename, hence the inode."""
        with self._lock:
            try:
                st = self.crl_path.stat()
            except OSError as exc:
                raise PkiError(f"cannot read CRL {self.crl_path}: {exc.strerror}") from None
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                pem = _read(self.crl_path, "CRL")
                self._revoked = self._parse(pem)
                self._pem, self._sha256 = pem, hashlib.sha256(pem).hexdigest()
                self._stamp = stamp

    def current(self) -> tuple[bytes, str]:
        """The CRL last verified (re-read if it changed) and its SHA-256, which silos compare with theirs."""
        self.reload()
        return self._pem, self._sha256

    def is_revoked(self, cert: x509.Certificate) -> bool:
        self.reload()
        return cert.serial_number in self._revoked

    def _parse(self, pem: bytes) -> frozenset[int]:
        return revoked_serials(pem, self.ca_cert, source=str(self.crl_path))


def revoked_serials(pem: bytes, ca_cert: x509.Certificate, *, source: str) -> frozenset[int]:
    """The serials a CRL revokes, once its issuer and signature are checked against the consortium CA."""
    try:
        crl = x509.load_pem_x509_crl(pem)
    except ValueError as exc:
        raise PkiError(f"{source} is not a PEM CRL: {exc}") from None
    if crl.issuer != ca_cert.subject:
        raise PkiError(
            f"{source} was issued by {crl.issuer.rfc4514_string()}, "
            f"not by the consortium CA {ca_cert.subject.rfc4514_string()}"
        )
    if not crl.is_signature_valid(ca_cert.public_key()):
        raise PkiError(f"the signature of {source} does not verify with the consortium CA's key")
    return frozenset(entry.serial_number for entry in crl)


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


def _extension(cert: x509.Certificate, kind: type[_Ext]) -> _Ext | None:
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read {what} {path}: {exc.strerror}") from None
