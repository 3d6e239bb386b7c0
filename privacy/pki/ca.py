"""The consortium CA, kept in one directory: `ca.pem`, `ca.key`, `crl.pem` and the index `issued.json`.

The index is the CA's memory: it is what lets the operator revoke a silo by name and what stops two live
certificates for one identity, except during a renewal (`renew_silo`, `renew_server`): then the renewed
certificate stands beside the old one, because the roster names each member's exact certificate and the old
one must keep working until a roster naming the new one is in force; the old one is revoked by serial after
that (`revoke(..., roster=...)` checks the order). Every change writes the CRL before the index, each by
atomic rename, so an interrupted revocation is either in force or not recorded at all (and can simply be run
again), never recorded but not in force. Issued keys are written after the index, so no certificate exists
that the CA could not revoke.
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
from privacy.pki.roster import AGGREGATOR, Roster
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
    key: Path | None  # None when the certificate is for a key the member keeps (a certificate request)
    serial: int
    not_after: datetime
    replaced: int | None = None  # the serial this certificate replaced, now revoked
    renews: int | None = None  # the live certificate a renewal stands beside (revoke it after the roster)


@dataclass(frozen=True)
class IssuedRecord:
    serial: int
    kind: str  # "server", "silo" or "operator"
    subject_id: str
    not_after: datetime
    revoked_at: datetime | None = None

    def live(self, now: datetime) -> bool:
        return self.revoked_at is None and now < self.not_after

    def days_left(self, now: datetime) -> int:
        """Whole days until it expires (negative once expired)."""
        return (self.not_after - now) // timedelta(days=1)

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
    renew: bool = False,
) -> IssuedPaths:
    """The aggregator's TLS certificate (`aggregator.pem`/`.key`): it must name every host silos dial.
    `renew`: beside the live one (`renew_server`)."""
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
        renew=renew,
    )


def issue_silo(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    silo_id: str,
    days: int = 825,
    valid_from: datetime | None = None,
    replace: bool = False,
    csr: bytes | None = None,
) -> IssuedPaths:
    """A silo's client certificate (`<silo_id>.pem`/`.key`); `replace` revokes the silo's live one. With
    `csr` (a request the silo made for its own key) it is for that key, and no key is written."""
    return _member(
        ca_dir,
        out_dir,
        SILO,
        silo_id,
        days=days,
        valid_from=valid_from,
        replace=replace,
        public_key=None if csr is None else csr_public_key(csr),
    )


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


def renew_silo(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    silo_id: str,
    days: int = 825,
    csr: bytes | None = None,
) -> IssuedPaths:
    """A new certificate for silo `silo_id` beside its live one, which is NOT revoked.

    The roster names the live certificate, so the silo keeps using it until a roster naming the new one is
    signed by a quorum and in force; only then is the old one revoked (by serial). With `csr` (PEM, from
    `python -m silo certificate-request`) the certificate is for the key the silo keeps, and no key is
    written; the request proves possession of the key, and the identity is `silo_id`, whatever it names.
    """
    public_key = None if csr is None else csr_public_key(csr)
    return _member(
        ca_dir,
        out_dir,
        SILO,
        silo_id,
        days=days,
        valid_from=None,
        replace=False,
        public_key=public_key,
        renew=True,
    )


def renew_server(
    ca_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, hosts: Sequence[str], days: int = 825
) -> IssuedPaths:
    """A new aggregator certificate beside the live one (see `renew_silo`: the roster names it too)."""
    return issue_server(ca_dir, out_dir, hosts=hosts, days=days, renew=True)


def renew_ca(ca_dir: str | os.PathLike[str], *, days: int = 3650) -> CaPaths:
    """The CA certificate again, with the same key and subject and a new validity, written over `ca.pem`.

    Certificates and CRLs the CA issued name its subject and verify with its key, so they stay valid under the
    renewed CA certificate: members replace their copy of `ca.pem` and restart at their convenience, before
    the old one expires. The old certificate is kept beside it as `ca-<serial>.pem`.
    """
    ca = _Ca.open(ca_dir)
    now = datetime.now(UTC)
    cert = (
        _builder(ca.cert.subject, ca.cert.subject, ca.key.public_key(), now - CLOCK_SKEW, now + _days(days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .sign(ca.key, hashes.SHA256())
    )
    old = ca.paths.directory / f"ca-{ca.cert.serial_number:x}.pem"
    _write(old, ca.cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(ca.paths.certificate, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return ca.paths


def revoke(
    ca_dir: str | os.PathLike[str],
    *,
    silo_id: str | None = None,
    serial: int | None = None,
    roster: Roster | None = None,
    expel: bool = False,
) -> int:
    """Revoke a silo's live certificate, or any certificate by serial; returns the serial revoked.

    While a renewal is pending (the identity has another live certificate) revoking is the last step of a
    rotation, so it asks for the roster in force and refuses a certificate that roster still names: revoking
    it would cut the member off until a roster naming its new certificate is in force. `expel` skips this.
    """
    if (silo_id is None) == (serial is None):
        raise TypeError("revoke takes exactly one of silo_id and serial")
    ca = _Ca.open(ca_dir)
    now = datetime.now(UTC)
    if silo_id is not None:
        live = ca.live_all(SILO, silo_id, now)
        if not live:
            raise PkiError(f"silo {silo_id!r} has no live certificate in {ca.paths.directory} to revoke")
        if len(live) > 1:
            listed = ", ".join(f"serial {r.serial:x} (expires {format_utc(r.not_after)})" for r in live)
            raise PkiError(
                f"silo {silo_id!r} has {len(live)} live certificates, a renewal being under way: {listed}; "
                "name the one to revoke with --serial"
            )
        target = live[0]
    else:
        target = next((r for r in ca.records if r.serial == serial), None)
        if target is None:
            raise PkiError(f"{ca.paths.directory} issued no certificate with serial {serial:x}")
        if target.revoked_at is not None:
            raise PkiError(f"certificate {serial:x} was already revoked on {format_utc(target.revoked_at)}")
    if not expel:
        _check_rotation_order(ca, target, roster, now)
    ca.revoke(target, now)
    ca.save(now)
    return target.serial


def _check_rotation_order(ca: _Ca, target: IssuedRecord, roster: Roster | None, now: datetime) -> None:
    others = [r for r in ca.live_all(target.kind, target.subject_id, now) if r.serial != target.serial]
    if not others or target.kind not in _ROSTER_ROLE:
        return
    who = f"{target.kind} {target.subject_id!r}"
    newer = ", ".join(f"{r.serial:x}" for r in others)
    if roster is None:
        raise PkiError(
            f"{who} has another live certificate (serial {newer}): revoking {target.serial:x} is the last "
            "step of a rotation, once the roster names the new certificate; give --roster with the roster "
            "the aggregator serves, so that this can be checked (or --expel to revoke it regardless)"
        )
    role = _ROSTER_ROLE[target.kind]
    named = [m for m in roster.members if m.role == role and m.cert.serial_number == target.serial]
    if named:
        raise PkiError(
            f"roster v{roster.version} still names certificate {target.serial:x} for {named[0].id!r}: "
            f"revoking it now cuts {named[0].id} off until a roster naming its new certificate (serial "
            f"{newer}) is in force; first draft one (python -m aggregator roster draft --previous), have a "
            "quorum of silos sign it, put it in [server] roster, then revoke (or give --expel to revoke it "
            "regardless)"
        )


def list_issued(ca_dir: str | os.PathLike[str]) -> list[IssuedRecord]:
    return _read_index(_existing(ca_dir))


def csr_public_key(pem: bytes) -> ec.EllipticCurvePublicKey:
    """The key of a certificate request, once its signature proves the requester holds the private half."""
    try:
        request = x509.load_pem_x509_csr(pem)
    except ValueError as exc:
        raise PkiError(f"not a PEM certificate request: {exc}") from None
    public = request.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(public.curve, ec.SECP256R1):
        raise PkiError(
            "the certificate request is not for an ECDSA P-256 key, the only kind a consortium uses"
        )
    if not request.is_signature_valid:
        raise PkiError("the certificate request's signature does not verify: it was not made with its key")
    return public


# which roster role a certificate kind serves as (operators are not on the roster)
_ROSTER_ROLE = {SILO: SILO, SERVER: AGGREGATOR}


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
        return next(iter(self.live_all(kind, subject_id, now)), None)

    def live_all(self, kind: str, subject_id: str, now: datetime) -> list[IssuedRecord]:
        """Oldest first: one, or two while a renewal is under way."""
        return [r for r in self.records if (r.kind, r.subject_id) == (kind, subject_id) and r.live(now)]

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
    public_key: ec.EllipticCurvePublicKey | None = None,
    renew: bool = False,
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
        public_key=public_key,
        renew=renew,
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
    renew: bool = False,
    public_key: ec.EllipticCurvePublicKey | None = None,
) -> IssuedPaths:
    """One leaf certificate and key, as `<subject_id>.pem`/`.key` in out_dir; valid no longer than the CA.

    `renew`: beside the live certificate, which stays live; `public_key`: for a key the member keeps (no key
    file is written)."""
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
    live = ca.live_all(kind, subject_id, now)
    previous = live[-1] if live else None
    written = (cert_path,) if public_key is not None else (key_path, cert_path)
    if renew:
        if len(live) > 1:
            raise PkiError(
                f"{kind} {subject_id!r} already has a renewed certificate (serial {live[-1].serial:x}) "
                f"beside serial {live[0].serial:x}: finish that rotation (revoke {live[0].serial:x} once the "
                f"roster names {live[-1].serial:x}), or revoke {live[-1].serial:x} to start over"
            )
        clash = next((p for p in written if p.exists()), None)
        if clash is not None:
            raise PkiError(
                f"{clash} already exists, and the certificate it may hold must keep working until the roster "
                "names the renewed one: write the renewal to another --out directory"
            )
    elif not replace:
        if previous is not None:
            renewal = (
                f", or renew-{kind} for a certificate beside it (which the roster must name before the old "
                "one is revoked)"
                if kind in _ROSTER_ROLE
                else ""
            )
            raise PkiError(
                f"{kind} {subject_id!r} already has a live certificate (serial {previous.serial:x}, "
                f"expires {format_utc(previous.not_after)}); use --replace (replace=True) to revoke it and "
                f"issue a new one{renewal}"
            )
        clash = next((p for p in written if p.exists()), None)
        if clash is not None:
            raise PkiError(f"{clash} already exists; use --replace (replace=True) to overwrite it")
    key = ec.generate_private_key(ec.SECP256R1()) if public_key is None else None
    public = public_key if key is None else key.public_key()
    not_after = min((valid_from or now) + _days(days), ca.cert.not_valid_after_utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_id)])
    cert = (
        _builder(subject, ca.cert.subject, public, valid_from or (now - CLOCK_SKEW), not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    if replace:
        for record in live:
            ca.revoke(record, now)
    ca.records.append(IssuedRecord(cert.serial_number, kind, subject_id, not_after))
    ca.save(now)
    out.mkdir(parents=True, exist_ok=True)
    if key is not None:
        _write(key_path, _private_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return IssuedPaths(
        cert_path,
        key_path if key is not None else None,
        cert.serial_number,
        not_after,
        replaced=previous.serial if replace and previous is not None else None,
        renews=previous.serial if renew and previous is not None else None,
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
