"""Certificates about to expire, said early with the command that renews each; a member's certificate request.

Every consortium certificate expires, the CA's included, and an expired one stops its holder at the next TLS
handshake. So the aggregator and the silo agents look ahead (`RENEW_WITHIN_DAYS` by default) and name, for
each certificate about to expire, its date and what renews it. Renewing a member's certificate is a roster
change, because the roster names exact certificates: the renewed one stands beside the old one until a roster
naming it is in force (docs/operator.md, "Renewing and rotating certificates").
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import NameOID

from privacy.pki.errors import PkiError
from privacy.pki.identity import check_id, format_utc
from privacy.pki.roster import AGGREGATOR, SILO, Roster

log = logging.getLogger(__name__)

RENEW_WITHIN_DAYS = 30
GUIDE = 'docs/operator.md, "Renewing and rotating certificates"'
_MEMBER_STEPS = (
    "then a roster naming the new certificate (python -m aggregator roster draft --previous), signed by a "
    "quorum of silos (python -m silo roster sign)"
)


@dataclass(frozen=True)
class Watched:
    """One certificate to look ahead for: what it is (for a person), and the command that renews it."""

    what: str
    cert: x509.Certificate
    renew: str


def expiry_warnings(
    watched: Iterable[Watched], *, within_days: int = RENEW_WITHIN_DAYS, now: datetime | None = None
) -> list[str]:
    """One line for each certificate that expires within `within_days` (or has expired), soonest first."""
    now = now or datetime.now(UTC)
    horizon = now + timedelta(days=within_days)
    due = sorted((w for w in watched if w.cert.not_valid_after_utc <= horizon), key=_expires)
    return [_warning(w, now) for w in due]


def _expires(w: Watched) -> datetime:
    return w.cert.not_valid_after_utc


def _warning(w: Watched, now: datetime) -> str:
    end = w.cert.not_valid_after_utc
    if end <= now:
        when = f"expired on {format_utc(end)}"
    else:
        days = (end - now) // timedelta(days=1)
        left = "less than a day" if days < 1 else f"{days} day{'s' * (days != 1)}"
        when = f"expires on {format_utc(end)}, in {left}"
    return f"{w.what} (serial {w.cert.serial_number:x}) {when}; to renew it: {w.renew} ({GUIDE})"


def ca_watch(cert: x509.Certificate, where: str) -> Watched:
    return Watched(
        f"the consortium CA certificate {where}",
        cert,
        "`python -m aggregator ca renew-ca --dir <CA directory>` on the CA holder's machine, then give every "
        "member the new ca.pem",
    )


def silo_self_renewal(silo_id: str) -> str:
    """What a silo's administrator does (the CA holder runs `silo_renewal`)."""
    return (
        "ask the CA holder for a renewed certificate (python -m aggregator ca renew-silo --silo-id "
        f"{silo_id}; to keep this key, send a request made with python -m silo certificate-request), sign "
        "the roster naming it (python -m silo roster sign), and install it over [connection] certificate and "
        "key: the running agent switches to it once the roster naming it is in force"
    )


def silo_renewal(silo_id: str) -> str:
    return (
        f"`python -m aggregator ca renew-silo --dir <CA directory> --out <new directory> --silo-id "
        f"{silo_id}` on the CA holder's machine, {_MEMBER_STEPS}"
    )


def aggregator_renewal() -> str:
    return (
        "`python -m aggregator ca renew-server --dir <CA directory> --out <new directory> --host <each "
        f"host>` on the CA holder's machine, {_MEMBER_STEPS}, then restart the aggregator with it"
    )


def roster_watch(roster: Roster) -> list[Watched]:
    """Every member certificate the roster names, with what renews it."""
    watched = []
    for m in roster.members:
        if m.role == SILO:
            watched.append(
                Watched(f"silo {m.id}'s certificate on roster v{roster.version}", m.cert, silo_renewal(m.id))
            )
        elif m.role == AGGREGATOR:
            watched.append(
                Watched(
                    f"the aggregator's certificate on roster v{roster.version}", m.cert, aggregator_renewal()
                )
            )
    return watched


def new_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """A new P-256 key in `path`, created owner-only and exclusively (never over an existing key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise PkiError(f"{path} already exists; refusing to overwrite a key") from None
    except OSError as exc:
        raise PkiError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())
    return key


def certificate_request(key: ec.EllipticCurvePrivateKey, member_id: str) -> bytes:
    """A PEM certificate request for `key`, naming `member_id`, for the CA holder to renew a certificate for a
    key the member keeps (`python -m aggregator ca renew-silo --csr`). The CA names the identity itself; the
    request's signature proves possession of the key."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, check_id(SILO, member_id))])
    request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return request.public_bytes(Encoding.PEM)


class ExpiryWatch:
    """The warnings of certificates that may change under it (a roster file the operator replaces): `check`
    logs each when it first comes up and again once its text changes, which the days left do daily."""

    def __init__(
        self,
        watched: Callable[[], list[Watched]],
        *,
        within_days: int = RENEW_WITHIN_DAYS,
        problems: Callable[[], list[str]] = list,
        logger: logging.Logger = log,
    ) -> None:
        self.watched = watched
        self.within_days = within_days
        self.problems = problems
        self.log = logger
        self._logged: set[str] = set()

    def warnings(self) -> list[str]:
        try:
            return [*self.problems(), *expiry_warnings(self.watched(), within_days=self.within_days)]
        except PkiError as exc:  # a roster file that cannot be read just now, say
            return [f"certificates could not be checked: {exc}"]

    def check(self) -> list[str]:
        found = self.warnings()
        for warning in found:
            if warning not in self._logged:
                self.log.warning("%s", warning)
        self._logged = set(found)
        return found

    def run(self, stop: threading.Event, every_seconds: float) -> None:
        """`check` every `every_seconds` until `stop` (on a thread of its own)."""
        while not stop.wait(every_seconds):
            self.check()
