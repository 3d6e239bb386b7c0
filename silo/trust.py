"""What this silo trusts, kept in its state directory: the pinned roster and every revocation it has seen;
and what it presents: its own certificate and key, re-read when the administrator replaces them.

The roster from the enrollment kit (`connection.roster`) is pinned on first start. The aggregator offers the
newest roster and CRL at every registration and, when they differ from the silo's, in heartbeat replies; a
roster replaces the pinned one only when a quorum of the pinned roster's silos signed it (members whose
certificate is revoked or out of date do not count), and a CRL counts only when the consortium CA signed it.
Neither can go backwards: an older roster is refused and revocations only accumulate. A local CRL file
(`connection.crl`), if the silo administrator keeps one, is read too (again before every roster offered), so
the aggregator cannot withhold a revocation. Whatever roster the silo holds, from the kit or adopted, must
have a quorum above `policy.roster_quorum_above` of its silos, so that no minority of silos can sign in
members.

A renewed certificate (`OwnCertificate`) is installed over the files `connection.certificate` and `.key`
name, while the agent runs. The agent switches to it once its pinned roster names it (or once the aggregator
refuses the running one): before that, peers holding the roster would refuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from fedlt.atomic import atomic_write, atomic_write_text
from privacy.dp.ledger import ledger_lock
from privacy.pki.errors import PkiError
from privacy.pki.identity import (
    MemberTrust,
    RevokedSerials,
    check_issued_by,
    check_valid_now,
    describe,
    format_utc,
    load_certificate,
    revoked_serials,
    silo_id_of,
)
from privacy.pki.renewal import Watched, ca_watch, silo_self_renewal
from privacy.pki.roster import DEFAULT_QUORUM_ABOVE, SILO, Roster, fingerprint, minimum_quorum
from privacy.pki.signing import load_private_key

log = logging.getLogger("silo")

PINNED_ROSTER = "roster.json"
REVOKED = "revoked.json"


class SiloTrust:
    def __init__(
        self,
        state_dir: Path,
        *,
        ca_pem: bytes,
        kit_roster: Path,
        crl: Path | None,
        quorum_above: Fraction | str = DEFAULT_QUORUM_ABOVE,
    ) -> None:
        """`quorum_above`: `policy.roster_quorum_above` (validated there, as text or a fraction); a roster
        whose quorum is not above it is neither pinned nor adopted."""
        self.state_dir = state_dir
        self.ca_pem = ca_pem
        self.quorum_above = Fraction(quorum_above)
        self._ca = load_certificate(ca_pem, source="the consortium CA certificate")
        pinned = state_dir / PINNED_ROSTER
        roster = pinned_roster(state_dir, kit_roster)
        _check_floor(roster, self.quorum_above, pinned=pinned if pinned.exists() else None, kit=kit_roster)
        if not pinned.exists():
            atomic_write(pinned, lambda fh: fh.write(roster.to_json()))
            log.info(
                "pinned roster v%d of %r (%s…) from %s",
                roster.version,
                roster.consortium,
                roster.digest()[:16],
                kit_roster,
            )
        self.revoked = RevokedSerials(_saved_serials(state_dir / REVOKED))
        self._roster = roster
        # the files other agents of this silo (its other studies') write too, re-read when they change
        self._shared = {name: _SharedFile(state_dir / name) for name in (PINNED_ROSTER, REVOKED)}
        self._reading = threading.Lock()
        self.members = MemberTrust(ca_pem, self, _Revocations(self))
        self._local_crl = crl
        self._lock = threading.Lock()
        self._refused: set[str] = set()  # digests of offered rosters already refused (and logged)
        self._noted: set[str] = set()
        self.crl_sha256 = ""  # of the last CRL the aggregator relayed
        self.offer_crl(b"")

    @property
    def roster(self) -> Roster:
        return self.current()

    def current(self) -> Roster:
        self.refresh()
        return self._roster

    def refresh(self) -> None:
        """Take what another agent of this silo (another study's) wrote since: a newer pinned roster, which
        that agent's checks adopted, and revocations it learned (never undone). A silo with several studies
        thus acts on one roster and one revocation list, whichever agent the aggregator tells what."""
        with self._reading:
            if self._shared[REVOKED].changed():
                self.revoked.add(_saved_serials(self._shared[REVOKED].path))
            if self._shared[PINNED_ROSTER].changed():
                on_disk = Roster.read(self._shared[PINNED_ROSTER].path)
                if on_disk.version > self._roster.version:
                    self._roster = on_disk

    def offer_roster(self, raw: bytes) -> bool:
        """Adopt a newer roster if a quorum of the pinned one's silos signed it and its own quorum is above
        this silo's floor (True); anything else is logged, once per roster offered. The local CRL is read
        first, so a signer revoked there does not count even if the aggregator relays no CRL."""
        if not raw:
            return False
        self._merge_local()
        pinned = self.state_dir / PINNED_ROSTER
        with self._lock, ledger_lock(pinned):
            self.refresh()
            seen = hashlib.sha256(raw).hexdigest()
            if seen in self._refused:
                return False
            try:
                offered = Roster.from_json(raw, source="the roster the aggregator offers")
                if offered.digest() == self.roster.digest() or offered.version < self.roster.version:
                    return False
                self.roster.check_successor(offered, revocations=self.revoked)
                check_roster_floor(offered, self.quorum_above)
            except PkiError as exc:
                self._refused.add(seen)
                log.warning("keeping the pinned roster v%d: %s", self.roster.version, exc)
                return False
            atomic_write(pinned, lambda fh: fh.write(offered.to_json()))
            self._roster = offered
        log.info("adopted roster v%d (%s…), signed by a quorum", offered.version, offered.digest()[:16])
        return True

    def note_once(self, key: str, message: str) -> None:
        """Log `message` as a warning the first time `key` comes up (checks that repeat every heartbeat)."""
        with self._lock:
            if key in self._noted:
                return
            self._noted.add(key)
        log.warning("%s", message)

    def offer_crl(self, pem: bytes) -> None:
        """Take the revocations of a CRL the aggregator relays, and of the local CRL file, if any."""
        if pem:
            self.crl_sha256 = hashlib.sha256(pem).hexdigest()
        self._merge(pem, "the CRL the aggregator sends")
        self._merge_local()

    def _merge_local(self) -> None:
        if self._local_crl is not None:
            self._merge(_read(self._local_crl), str(self._local_crl))

    def _merge(self, pem: bytes, source: str) -> None:
        if not pem:
            return
        try:
            serials = revoked_serials(pem, self._ca, source=source)
        except PkiError as exc:
            log.warning("ignoring %s: %s", source, exc)
            return
        saved = self.state_dir / REVOKED
        with self._lock, ledger_lock(saved):
            # the file may hold revocations another agent on this state directory (another study's) took
            self.revoked.add(_saved_serials(saved))
            if serials <= _saved_serials(saved):
                return
            self.revoked.add(serials)
            text = json.dumps({"serials": sorted(f"{s:x}" for s in self.revoked.serials)})
            atomic_write_text(saved, text)
        log.info("revocations now known: %d certificates", len(self.revoked.serials))


class _SharedFile:
    """A file of the state directory that several agents replace atomically: whether it changed since it
    was last looked at (its inode and time, from one stat; a replaced file is a new inode)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None

    def changed(self) -> bool:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return False
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return False
        self._seen = seen
        return True


class _Revocations:
    """The silo's revocations as `MemberTrust` checks them: those of every agent of the silo, as of now."""

    def __init__(self, trust: SiloTrust) -> None:
        self.trust = trust

    def is_revoked(self, cert: x509.Certificate) -> bool:
        self.trust.refresh()
        return self.trust.revoked.is_revoked(cert)


def _saved_serials(path: Path) -> frozenset[int]:
    serials = json.loads(path.read_text())["serials"] if path.exists() else []
    return frozenset(int(s, 16) for s in serials)


def check_roster_floor(roster: Roster, above: Fraction) -> None:
    """`Roster.check_quorum` against this silo's policy, saying which setting refuses it."""
    try:
        roster.check_quorum(above=above)
    except PkiError as exc:
        raise PkiError(f"{exc}, as this silo's policy.roster_quorum_above asks") from None


def _check_floor(roster: Roster, above: Fraction, *, pinned: Path | None, kit: Path) -> None:
    """Stop the agent on a roster fewer silos than its policy asks could replace, saying what to ask for."""
    try:
        roster.check_quorum(above=above)
    except PkiError as exc:
        wanted = minimum_quorum(len(roster.silo_ids), above)
        if pinned is None:
            raise PkiError(
                f"not pinning the enrollment kit's roster {kit}: {exc}, as this silo's "
                "policy.roster_quorum_above asks; so few silos could sign in members, and Sybils count as "
                "colluders against every secure sum. Ask the operator for a roster drafted with a higher "
                f"quorum (python -m aggregator roster draft --quorum {wanted} or more), or lower "
                "policy.roster_quorum_above in silo.toml knowingly"
            ) from None
        raise PkiError(
            f"the pinned roster {pinned}: {exc}, as this silo's policy.roster_quorum_above (raised since "
            "the roster was pinned?) asks. Lower policy.roster_quorum_above knowingly, or lower it until the "
            f"consortium has adopted a roster drafted with --quorum {wanted} or more"
        ) from None


def pinned_roster(state_dir: Path, kit_roster: Path) -> Roster:
    """The roster this silo trusts: the one pinned in its state directory, else the enrollment kit's."""
    pinned = state_dir / PINNED_ROSTER
    return Roster.read(pinned if pinned.exists() else kit_roster)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read CRL {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Credentials:
    """A certificate of the consortium CA and its private key, as files held them."""

    cert_pem: bytes
    key_pem: bytes
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    silo_id: str

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def describe(self) -> str:
        expires = format_utc(self.cert.not_valid_after_utc)
        return f"{describe(self.cert)}, sha256 {self.fingerprint[:16]}…, expires {expires}"


class OwnCertificate:
    """This silo's certificate and key files: read and checked at start (a problem there is fatal and says
    which), then watched for a renewed pair the administrator installs over them."""

    def __init__(self, certificate: Path, key: Path, ca_pem: bytes, *, ca_path: Path) -> None:
        self.certificate, self.key = certificate, key
        self.ca = load_certificate(ca_pem, source=f"the consortium CA certificate {ca_path}")
        self.ca_path = ca_path
        self._stamp: tuple | None = None
        self._on_disk: Credentials | None = None
        self._noted: set[str] = set()

    def read(self) -> Credentials:
        """The pair on disk, or PkiError naming the problem: expired or not yet valid (the CA or the
        certificate), not issued by the consortium CA, not this key's, not a silo's."""
        try:
            check_valid_now(self.ca)
        except PkiError as exc:
            raise PkiError(f"the consortium CA certificate {self.ca_path}: {exc}") from None
        try:
            pem = self.certificate.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read certificate {self.certificate}: {exc.strerror}") from None
        cert = load_certificate(pem, source=str(self.certificate))
        check_issued_by(cert, self.ca)
        try:
            check_valid_now(cert)
        except PkiError as exc:
            raise PkiError(f"this silo's certificate {self.certificate}: {exc}") from None
        key = load_private_key(self.key)  # refuses a key file others may read
        if key.public_key() != cert.public_key():
            raise PkiError(f"{self.key} is not the key of {self.certificate}")
        key_pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())  # the key just checked
        return Credentials(pem, key_pem, cert, key, silo_id_of(cert))

    def renewed(self, running: Credentials) -> Credentials | None:
        """The pair on disk if it is a valid one for the same silo other than `running`; re-read only when
        the files change, and a pair caught half-way through replacement (certificate and key not matching)
        waits for the next change."""
        try:
            stamp = tuple(
                (st.st_ino, st.st_mtime_ns, st.st_size) for st in map(os.stat, (self.certificate, self.key))
            )
        except OSError:
            return None
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                found = self.read()
            except PkiError as exc:
                self._note(
                    str(exc),
                    f"the certificate files hold no usable pair yet ({exc}); keeping {running.describe()}",
                )
                found = None
            if found is not None and found.silo_id != running.silo_id:
                self._note(
                    found.fingerprint,
                    f"{self.certificate} now holds a certificate of silo {found.silo_id}, not "
                    f"{running.silo_id}; ignoring it",
                )
                found = None
            self._on_disk = found
        on_disk = self._on_disk
        if on_disk is None or on_disk.fingerprint == running.fingerprint:
            return None
        return on_disk

    def _note(self, key: str, message: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning("%s", message)


def switch_due(trust: SiloTrust, running: Credentials, renewed: Credentials | None) -> bool:
    """Whether to switch to `renewed` now: the pinned roster names it (peers holding the roster accept it).
    Until then, say once what stops it."""
    roster = trust.roster
    if renewed is not None:
        try:
            roster.member_of(renewed.cert, role=SILO, member_id=renewed.silo_id)
            return True
        except PkiError:
            pass
    try:
        roster.member_of(running.cert, role=SILO, member_id=running.silo_id)
    except PkiError:
        named = roster.member(running.silo_id)
        wanted = f"sha256 {named.fingerprint[:16]}…" if named else "no certificate"
        trust.note_once(
            f"roster-{roster.digest()}-{renewed.fingerprint if renewed else ''}",
            f"roster v{roster.version} does not name this silo's running certificate ({running.describe()}); "
            f"it names {wanted} for {running.silo_id}: install that certificate and its key over "
            "[connection] certificate and key; the agent switches to it when the files change",
        )
        return False
    if renewed is not None:
        trust.note_once(
            f"pending-{renewed.fingerprint}-{roster.digest()}",
            f"the certificate files hold a renewed certificate ({renewed.describe()}) that roster "
            f"v{roster.version} does not name yet: keeping the running one ({running.describe()}) until a "
            "roster naming it, signed by a quorum of silos, is adopted",
        )
    return False


def expiry_watch(credentials: Credentials, own: OwnCertificate) -> list[Watched]:
    """This silo's own certificate and the CA, for `privacy.pki.renewal.expiry_warnings`."""
    return [
        Watched(
            f"this silo's certificate {own.certificate}",
            credentials.cert,
            silo_self_renewal(credentials.silo_id),
        ),
        ca_watch(own.ca, str(own.ca_path)),
    ]
