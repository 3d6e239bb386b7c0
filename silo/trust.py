"""What this silo trusts, kept in its state directory: the pinned roster and every revocation it has seen.

The roster from the enrollment kit (`connection.roster`) is pinned on first start. The aggregator offers the
newest roster and CRL at every registration; a roster replaces the pinned one only when a quorum of the pinned
roster's silos signed it, and a CRL counts only when the consortium CA signed it. Neither can go backwards:
an older roster is refused and revocations only accumulate. A local CRL file (`connection.crl`), if the silo
administrator keeps one, is read too, so the aggregator cannot withhold a revocation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fedlt.atomic import atomic_write, atomic_write_text
from privacy.pki.errors import PkiError
from privacy.pki.identity import load_certificate, revoked_serials
from privacy.pki.roster import Roster
from privacy.pki.trust import MemberTrust, RevokedSerials

log = logging.getLogger("silo")

PINNED_ROSTER = "roster.json"
REVOKED = "revoked.json"


class SiloTrust:
    def __init__(self, state_dir: Path, *, ca_pem: bytes, kit_roster: Path, crl: Path | None) -> None:
        self.state_dir = state_dir
        self.ca_pem = ca_pem
        self._ca = load_certificate(ca_pem, source="the consortium CA certificate")
        pinned = state_dir / PINNED_ROSTER
        roster = pinned_roster(state_dir, kit_roster)
        if not pinned.exists():
            atomic_write(pinned, lambda fh: fh.write(roster.to_json()))
            log.info(
                "pinned roster v%d of %r (%s…) from %s",
                roster.version,
                roster.consortium,
                roster.digest()[:16],
                kit_roster,
            )
        saved = state_dir / REVOKED
        serials = json.loads(saved.read_text())["serials"] if saved.exists() else []
        self.revoked = RevokedSerials(frozenset(int(s, 16) for s in serials))
        self._roster = roster
        self.members = MemberTrust(ca_pem, self, self.revoked)
        self._local_crl = crl
        self.offer_crl(b"")

    @property
    def roster(self) -> Roster:
        return self._roster

    def current(self) -> Roster:
        return self._roster

    def offer_roster(self, raw: bytes) -> None:
        """Adopt a newer roster if a quorum of the pinned one's silos signed it; anything else is logged."""
        if not raw:
            return
        try:
            offered = Roster.from_json(raw, source="the roster the aggregator offers")
            if offered.digest() == self.roster.digest():
                return
            self.roster.check_successor(offered)
        except PkiError as exc:
            log.warning("keeping the pinned roster v%d: %s", self.roster.version, exc)
            return
        atomic_write(self.state_dir / PINNED_ROSTER, lambda fh: fh.write(offered.to_json()))
        self._roster = offered
        log.info("adopted roster v%d (%s…), signed by a quorum", offered.version, offered.digest()[:16])

    def offer_crl(self, pem: bytes) -> None:
        """Take the revocations of a CRL the aggregator relays, and of the local CRL file, if any."""
        self._merge(pem, "the CRL the aggregator sends")
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
        if self.revoked.add(serials):
            text = json.dumps({"serials": sorted(f"{s:x}" for s in self.revoked.serials)})
            atomic_write_text(self.state_dir / REVOKED, text)
            log.info("revocations now known: %d certificates", len(self.revoked.serials))


def pinned_roster(state_dir: Path, kit_roster: Path) -> Roster:
    """The roster this silo trusts: the one pinned in its state directory, else the enrollment kit's."""
    pinned = state_dir / PINNED_ROSTER
    return Roster.read(pinned if pinned.exists() else kit_roster)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read CRL {path}: {exc.strerror}") from None
