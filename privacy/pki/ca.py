"""The consortium CA, kept in one directory: `ca.pem`, `ca.key`, `crl.pem` and the index `issued.json`.

The index is the CA's memory: it is what lets the operator revoke a silo by name and what stops two live
certificates for one identity. Every change writes the CRL before the index, each by atomic rename, so an
interrupted revocation is either in force or not recorded at all (and can simply be run again), never
recorded but not in force. Issued keys are written after the index, so no certificate exists that the CA
could not revoke.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

from fedlt.atomic import atomic_write
from privacy.pki.errors import PkiError  # callers import it from here too
from privacy.pki.identity import OPERATOR, SILO, check_id, format_utc, identity_uri, read_certificate
from privacy.pki.signing import load_private_key

SERVER = "server"
SERVER_ID = "aggregator"
CRL_DAYS = 30
# Default certificates start a little in the past, so a member whose clock lags the CA's can use them at once.
CLOCK_SKEW = timedelta(minutes=5)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


@dataclass(frozen=True)
class CaPaths:
    directory: Path
    certificate: Path
    key: Path
    crl: Path
    index: Path

    @classmethod
    def of(cls, directory: str | os.PathLike[str]) -> CaPaths:
        d = Path(directory)
        return cls(d, d / "ca.pem", d / "ca.key", d / "crl.pem", d / "issued.json")


@dataclass(frozen=True)
class IssuedPaths:
    certificate: Path
    key: Path
    serial: int
    not_after: datetime
    replaced: int | None = None  # the serial this certificate replaced, now revoked


@dataclass(frozen=True)
class IssuedRecord:
    serial: int
    kind: str  # "server", "silo" or "operator"
    subject_id: str
    not_after: datetime
    revoked_at: datetime | None = None

    def live(self, now: datetime) -> bool:
        return self.revoked_at is None and now < self.not_after

    def to_json(self) -> dict[str, str | None]:
        return {
            "serial": f"{self.serial:x}",
            "kind": self.kind,
            "id": self.subject_id,
            "not_after": self.not_after.isoformat(),
            "revoked_at": None if self.revoked_at is None else self.revoked_at.isoformat(),
        }

    @classmethod
    def from_json(cls, row: dict[str, str | None]) -> IssuedRecord:
        revoked = row["revoked_at"]
        return cls(
            serial=int(str(row["serial"]), 16),
            kind=str(row["kind"]),
            subject_id=str(row["id"]),
            not_after=datetime.fromisoformat(str(row["not_after"])),
            revoked_at=None if revoked is None else datetime.fromisoformat(revoked),
        )


def init_ca(directory: str | os.PathLike[str], *, name: str, days: int = 3650) -> CaPaths:
    """A new CA; refuses a directory that already holds one, so a CA key is never overwritten."""
    paths = CaPaths.of(directory)
    existing = [p for p in (paths.key, paths.certificate, paths.crl, paths.index) if p.exists()]
    if existing:
        raise PkiError(f"{paths.directory} already holds a CA ({existing[0].name}); refusing to overwrite it")
    if not 1 <= len(name.strip()) <= 64:
        raise PkiError(f"the CA name must have 1 to 64 characters, got {name!r}")
    now = datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name.strip())])
    cert = (
        _builder(subject, subject, key.public_key(), now - CLOCK_SKEW, now + _days(days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    paths.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _create_private_key(paths.key, key)
    _write(paths.certificate, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _Ca(paths, cert, key, []).save(now)
    return paths


def issue_server(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    hosts: Sequence[str],
    days: int = 825,
    valid_from: datetime | None = None,
    replace: bool = False,
) -> IssuedPaths:
    """The aggregator's TLS certificate (`aggregator.pem`/`.key`): it must name every host silos dial."""
    return _issue(
        ca_dir,
        out_dir,
        kind=SERVER,
        subject_id=SERVER_ID,
        names=_host_names(hosts),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        days=days,
        valid_from=valid_from,
        replace=replace,
    )


def issue_silo(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    silo_id: str,
    days: int = 825,
    valid_from: datetime | None = None,
    replace: bool = False,
) -> IssuedPaths:
    """A silo's client certificate (`<silo_id>.pem`/`.key`); `replace` revokes the silo's live one."""
    return _member(ca_dir, out_dir, SILO, silo_id, days=days, valid_from=valid_from, replace=replace)


def issue_operator(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    name: str = "operator",
    days: int = 825,
    valid_from: datetime | None = None,
    replace: bool = False,
) -> IssuedPaths:
    """A client certificate for the operator's status queries (`<name>.pem`/`.key`); it is not a silo."""
    return _member(ca_dir, out_dir, OPERATOR, name, days=days, valid_from=valid_from, replace=replace)


def revoke(ca_dir: str | os.PathLike[str], *, silo_id: str | None = None, serial: int | None = None) -> int:
    """Revoke a silo's live certificate, or any certificate by serial; returns the serial revoked."""
    if (silo_id is None) == (serial is None):
        raise TypeError("revoke takes exactly one of silo_id and serial")
    ca = _Ca.open(ca_dir)
    now = datetime.now(UTC)
    if silo_id is not None:
        target = ca.live(SILO, silo_id, now)
        if target is None:
            raise PkiError(f"silo {silo_id!r} has no live certificate in {ca.paths.directory} to revoke")
    else:
        target = next((r for r in ca.records if r.serial == serial), None)
        if target is None:
            raise PkiError(f"{ca.paths.directory} issued no certificate with serial {serial:x}")
        if target.revoked_at is not None:
            raise PkiError(f"certificate {serial:x} was already revoked on {format_utc(target.revoked_at)}")
    ca.revoke(target, now)
    ca.save(now)
    return target.serial


def list_issued(ca_dir: str | os.PathLike[str]) -> list[IssuedRecord]:
    return _read_index(_existing(ca_dir))


@dataclass
class _Ca:
    paths: CaPaths
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    records: list[IssuedRecord]

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> _Ca:
        paths = _existing(directory)
        cert = read_certificate(paths.certificate)
        key = load_private_key(paths.key)
        if key.public_key() != cert.public_key():
            raise PkiError(f"{paths.key} is not the key of {paths.certificate}")
        return cls(paths, cert, key, _read_index(paths))

    def live(self, kind: str, subject_id: str, now: datetime) -> IssuedRecord | None:
        return next(
            (r for r in self.records if (r.kind, r.subject_id) == (kind, subject_id) and r.live(now)), None
        )

    def revoke(self, record: IssuedRecord, now: datetime) -> None:
        self.records[self.records.index(record)] = dataclasses.replace(record, revoked_at=now)

    def save(self, now: datetime) -> None:
        """CRL first, then the index: see the module docstring."""
        _write(self.paths.crl, self._crl(now), private=False)
        index = {"certificates": [r.to_json() for r in self.records]}
        _write(self.paths.index, (json.dumps(index, indent=2) + "\n").encode(), private=False)

    def _crl(self, now: datetime) -> bytes:
        revoked = [r for r in self.records if r.revoked_at is not None]
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now)
            .next_update(now + timedelta(days=CRL_DAYS))
            # Revocations are never undone, so their count orders the CRLs as RFC 5280 asks.
            .add_extension(x509.CRLNumber(len(revoked) + 1), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        for r in revoked:
            entry = x509.RevokedCertificateBuilder().serial_number(r.serial).revocation_date(r.revoked_at)
            builder = builder.add_revoked_certificate(entry.build())
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _member(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    kind: str,
    member_id: str,
    *,
    days: int,
    valid_from: datetime | None,
    replace: bool,
) -> IssuedPaths:
    return _issue(
        ca_dir,
        out_dir,
        kind=kind,
        subject_id=check_id(kind, member_id),
        names=[x509.UniformResourceIdentifier(identity_uri(kind, member_id))],
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        days=days,
        valid_from=valid_from,
        replace=replace,
    )


def _issue(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    kind: str,
    subject_id: str,
    names: list[x509.GeneralName],
    usage: ObjectIdentifier,
    days: int,
    valid_from: datetime | None,
    replace: bool,
) -> IssuedPaths:
    """One leaf certificate and key, as `<subject_id>.pem`/`.key` in out_dir; valid no longer than the CA."""
    if valid_from is not None and valid_from.tzinfo is None:
        raise ValueError("valid_from must be timezone-aware")
    ca = _Ca.open(ca_dir)
    out = Path(out_dir)
    if out.resolve() == ca.paths.directory.resolve():
        raise PkiError(
            f"write issued keys outside the CA directory {ca.paths.directory}, which holds the CA key"
        )
    now = datetime.now(UTC)
    if now >= ca.cert.not_valid_after_utc:
        raise PkiError(f"the consortium CA expired on {format_utc(ca.cert.not_valid_after_utc)}")
    cert_path, key_path = out / f"{subject_id}.pem", out / f"{subject_id}.key"
    previous = ca.live(kind, subject_id, now)
    if not replace:
        if previous is not None:
            raise PkiError(
                f"{kind} {subject_id!r} already has a live certificate (serial {previous.serial:x}, "
                f"expires {format_utc(previous.not_after)}); use --replace (replace=True) to revoke it and "
                "issue a new one"
            )
        clash = next((p for p in (key_path, cert_path) if p.exists()), None)
        if clash is not None:
            raise PkiError(f"{clash} already exists; use --replace (replace=True) to overwrite it")
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min((valid_from or now) + _days(days), ca.cert.not_valid_after_utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_id)])
    cert = (
        _builder(subject, ca.cert.subject, key.public_key(), valid_from or (now - CLOCK_SKEW), not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    if previous is not None:
        ca.revoke(previous, now)
    ca.records.append(IssuedRecord(cert.serial_number, kind, subject_id, not_after))
    ca.save(now)
    out.mkdir(parents=True, exist_ok=True)
    _write(key_path, _private_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return IssuedPaths(
        cert_path, key_path, cert.serial_number, not_after, None if previous is None else previous.serial
    )


def _host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """IP literals become IPAddress names, everything else DNSName, as TLS clients match them."""
    if isinstance(hosts, str) or not hosts:
        raise PkiError("a server certificate needs a list of one or more host names or IP addresses")
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if len(host) > 253 or not _HOSTNAME.fullmatch(host):
                raise PkiError(
                    f"invalid host {host!r}: give a DNS name (letters, digits, '-', '.') or an IP address, "
                    "without a port"
                ) from None
            names.append(x509.DNSName(host.lower()))
    return names


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    not_before: datetime,
    not_after: datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _days(days: int) -> timedelta:
    if days < 1:
        raise PkiError(f"a certificate must be valid for at least 1 day, got {days}")
    return timedelta(days=days)


def _existing(directory: str | os.PathLike[str]) -> CaPaths:
    paths = CaPaths.of(directory)
    if not paths.certificate.exists():
        raise PkiError(f"no consortium CA in {paths.directory} ({paths.certificate.name} is missing)")
    return paths


def _read_index(paths: CaPaths) -> list[IssuedRecord]:
    try:
        rows = json.loads(paths.index.read_text())["certificates"]
        return [IssuedRecord.from_json(row) for row in rows]
    except OSError as exc:
        raise PkiError(f"cannot read the CA index {paths.index}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PkiError(f"the CA index {paths.index} is corrupt: {exc!r}") from None


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _create_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Created 0600 and exclusively: never readable by others, and never over an existing CA key."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise PkiError(f"{path} already exists; refusing to overwrite a CA key") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(_private_pem(key))
        fh.flush()
        os.fsync(fh.fileno())


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Atomic; the temporary file is created 0600, and only public files are opened up to 0644 after."""
    atomic_write(path, lambda fh: fh.write(data))
    if not private:
        path.chmod(0o644)
