"""The consortium roster: who the members are, pinned by every silo, changed only by a quorum of silos.

A certificate from the consortium CA proves only that the CA holder issued it, and the operator may hold the
CA key. So a silo trusts a peer, the RoundSpec signer or the aggregator's TLS endpoint only if its pinned
roster names that exact certificate (SHA-256 of its DER encoding) under that id and role. The first roster
reaches a silo with its enrollment kit, out of band; every later version must carry valid signatures from at
least `quorum` silo members of the version the silo holds (an operator alone cannot add a Sybil or swap a
member's certificate). A signature counts only if the pinned certificate it verifies under is valid now and
not revoked (an expelled member's key may be the operator's now), and each certificate and key is listed
once, so nobody votes twice. The roster body is canonical JSON, so members sign exactly what every silo
parses.

File format (JSON): `{"consortium", "version", "quorum", "members": [{"id", "role", "certificate"}],
"signatures": {"<silo id>": "<base64 DER ECDSA>"}}`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from privacy.pki.errors import PkiError
from privacy.pki.identity import AGGREGATOR, SILO, check_id, check_valid_now, describe, load_certificate
from privacy.pki.signing import sign, verify

log = logging.getLogger(__name__)

ROSTER_CONTEXT = "fedlt/roster/v1"
ROLES = (AGGREGATOR, SILO)
# silo.config's default policy.roster_quorum_above: a silo refuses a roster whose quorum is not above this
# fraction of its silos (so that no minority signs the next version)
DEFAULT_QUORUM_ABOVE = Fraction(1, 2)


class Revocations(Protocol):
    """What the consortium CA revoked: a silo's union of every CRL it saw, the aggregator's CRL file."""

    def is_revoked(self, cert: x509.Certificate) -> bool: ...


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER encoding, hex: what a member's administrator reads out of band."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


@dataclass(frozen=True)
class Member:
    id: str
    role: str
    certificate: bytes  # PEM

    @property
    def cert(self) -> x509.Certificate:
        return load_certificate(self.certificate, source=f"the roster's certificate of {self.id}")

    @functools.cached_property
    def fingerprint(self) -> str:
        """Kept once computed: a lookup by certificate compares every member's, and parsing each PEM again
        made a lookup 1.6 ms at 300 silos and a secure sum's credential checks O(n²) (issue 37)."""
        return fingerprint(self.cert)


@dataclass(frozen=True)
class Roster:
    consortium: str
    version: int
    quorum: int  # silo signatures (by members of this version) that the next version needs
    members: tuple[Member, ...]
    signatures: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(sorted(self.members, key=_order)))  # one canonical order
        problems = []
        if not self.consortium:
            problems.append("it names no consortium")
        if self.version < 1:
            problems.append(f"version must be >= 1, got {self.version}")
        ids = [m.id for m in self.members]
        if len(set(ids)) != len(ids):
            problems.append("a member id appears twice")
        parsed = []
        for m in self.members:
            if m.role not in ROLES:
                problems.append(f"{m.id}: unknown role {m.role!r} (roles: {', '.join(ROLES)})")
            try:
                check_id(m.role, m.id)
                parsed.append((m, m.cert))
            except PkiError as exc:
                problems.append(str(exc))
        problems += _listed_twice(parsed)
        silos = len(self.silo_ids)
        if not 1 <= self.quorum <= max(silos, 1):
            problems.append(f"quorum must be between 1 and the {silos} silo members, got {self.quorum}")
        if not any(m.role == AGGREGATOR for m in self.members):
            problems.append("it names no aggregator")
        if problems:
            raise PkiError("roster: " + "; ".join(problems))

    @property
    def silo_ids(self) -> tuple[str, ...]:
        return tuple(sorted(m.id for m in self.members if m.role == SILO))

    def body(self) -> bytes:
        """The canonical bytes members sign: everything but the signatures."""
        return json.dumps(self._body_tree(), sort_keys=True, separators=(",", ":")).encode()

    def _body_tree(self) -> dict:
        return {
            "consortium": self.consortium,
            "version": self.version,
            "quorum": self.quorum,
            "members": [
                {"id": m.id, "role": m.role, "certificate": m.certificate.decode()} for m in self.members
            ],
        }

    def digest(self) -> str:
        return hashlib.sha256(self.body()).hexdigest()

    def current(self) -> Roster:
        """A roster is its own source of rosters (`MemberTrust` also takes a file the operator replaces)."""
        return self

    def member_of(self, cert: x509.Certificate, *, role: str, member_id: str | None = None) -> Member:
        """The member holding exactly `cert` in `role` (and named `member_id`), or PkiError."""
        print_ = fingerprint(cert)
        for m in self.members:
            if m.role == role and m.fingerprint == print_ and member_id in (None, m.id):
                return m
        who = f"{role} {member_id!r}" if member_id else f"the {role}"
        named = self.member(member_id, role=role) if member_id else None
        if named is None and role == AGGREGATOR:
            named = next((m for m in self.members if m.role == AGGREGATOR), None)
        renewal = (
            ""
            if named is None
            else f"; it names another certificate (sha256 {named.fingerprint[:16]}…) for {named.id}. A "
            "renewed certificate counts only once a roster naming it, signed by a quorum of the silos, is in "
            "force (python -m aggregator roster draft --previous, then python -m silo roster sign); until "
            "then use the certificate the roster names"
        )
        raise PkiError(
            f"roster v{self.version} of {self.consortium!r} does not name this certificate "
            f"(sha256 {print_[:16]}…) as {who}{renewal}"
        )

    def member(self, member_id: str, *, role: str = SILO) -> Member | None:
        return next((m for m in self.members if m.id == member_id and m.role == role), None)

    def signed_by(self, member: Member, key: ec.EllipticCurvePrivateKey) -> Roster:
        """This roster with `member`'s signature added (its administrator signs after checking the body)."""
        signature = sign(key, self.body(), context=ROSTER_CONTEXT)
        return replace(self, signatures={**self.signatures, member.id: signature})

    def check_successor(self, successor: Roster, *, revocations: Revocations) -> None:
        """Accept `successor` only if it is newer, of this consortium, and signed by a quorum of our silos.

        A signature counts under the certificate this roster names for its signer, and only while that
        certificate is valid and not revoked: an expelled member's key may be in the operator's hands. Each
        member's certificate and key are distinct (`__post_init__`), so each silo counts once."""
        if successor.consortium != self.consortium:
            raise PkiError(f"a roster of {successor.consortium!r} cannot replace one of {self.consortium!r}")
        if successor.version <= self.version:
            raise PkiError(f"roster v{successor.version} is not newer than the pinned v{self.version}")
        body = successor.body()
        valid, void = [], []
        for silo_id, signature in sorted(successor.signatures.items()):
            member = self.member(silo_id)
            if member is None:
                continue
            try:
                verify(member.cert, signature, body, context=ROSTER_CONTEXT)
            except PkiError:
                continue
            reason = _cannot_vote(member.cert, revocations)
            if reason:
                void.append(f"{silo_id} ({reason})")
            else:
                valid.append(silo_id)
        if len(valid) < self.quorum:
            uncounted = f"; not counted: {'; '.join(void)}" if void else ""
            raise PkiError(
                f"roster v{successor.version} carries {len(valid)} valid signatures of members of the pinned "
                f"v{self.version} ({', '.join(valid) or 'none'}); it needs {self.quorum}{uncounted}"
            )

    def check_quorum(self, *, above: Fraction) -> None:
        """Refuse a quorum that silos no more than the fraction `above` of this roster's silos reach: a
        minority could then sign in Sybils, who count as colluders against every secure sum."""
        silos = len(self.silo_ids)
        if self.quorum <= above * silos:
            raise PkiError(
                f"roster v{self.version} of {self.consortium!r} has quorum {self.quorum} of its {silos} "
                f"silos, not above {above} of them (that takes {minimum_quorum(silos, above)})"
            )

    def describe(self) -> str:
        """What an administrator compares, out of band, before pinning or signing a roster."""
        lines = [
            f"roster v{self.version} of consortium {self.consortium!r} (body sha256 {self.digest()})",
            f"a next version needs {self.quorum} signatures of this version's silos",
        ]
        lines += [
            f"  {m.role:<10} {m.id:<24} sha256 {m.fingerprint}" for m in sorted(self.members, key=_order)
        ]
        signed = ", ".join(sorted(self.signatures)) or "nobody"
        lines.append(f"signed by: {signed}")
        return "\n".join(lines)

    # --- files --------------------------------------------------------------------------------------

    def to_json(self) -> bytes:
        signatures = {k: base64.b64encode(v).decode() for k, v in sorted(self.signatures.items())}
        return (json.dumps({**self._body_tree(), "signatures": signatures}, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, *, source: str = "the roster") -> Roster:
        try:
            tree = json.loads(raw)
            members = tuple(
                Member(str(m["id"]), str(m["role"]), str(m["certificate"]).encode()) for m in tree["members"]
            )
            signatures = {str(k): base64.b64decode(v, validate=True) for k, v in tree["signatures"].items()}
            version, quorum = tree["version"], tree["quorum"]
            if not isinstance(version, int) or not isinstance(quorum, int) or isinstance(version, bool):
                raise TypeError("version and quorum are integers")
            return cls(str(tree["consortium"]), version, quorum, members, signatures)
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error, RecursionError) as exc:
            raise PkiError(f"{source} is not a fedlt roster: {exc}") from None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Roster:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read roster {path}: {exc.strerror}") from None
        return cls.from_json(raw, source=str(path))


class RosterFile:
    """The aggregator's roster file, re-read when the operator replaces it with a version the silos signed.

    The aggregator offers it to every silo (at registration and in heartbeat replies) and admits only the
    silos it names; each silo decides for itself whether to adopt it (`Roster.check_successor`). A
    replacement that silos will not adopt (too few signatures, not newer) is still served, since the operator
    may be on the way to a signed one, but `problem` says why silos refuse it, and it is logged once.
    """

    def __init__(self, path: str | os.PathLike[str], *, revocations: Revocations | None = None) -> None:
        """`revocations`: the CRL the aggregator serves, so that `problem` counts signers as silos do;
        None where no CRL is at hand (a signer's revocation then goes unnoticed here, not at the silos)."""
        self.path = Path(path)
        self.revocations = _NOTHING_REVOKED if revocations is None else revocations
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._raw = b""
        self._roster: Roster | None = None
        self._adopted: Roster | None = None  # the last version read that silos would adopt
        self.problem = ""
        self.current()

    def current(self) -> Roster:
        return self._load()[0]

    def raw(self) -> bytes:
        return self._load()[1]

    def _load(self) -> tuple[Roster, bytes]:
        """The roster in the file; once one was read, a file that cannot be read or parsed (caught half-way
        through a copy, say) leaves the last good one in force, with a `problem`, and is read again."""
        with self._lock:
            try:
                st = self.path.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                if stamp != self._stamp or self._roster is None:
                    raw = self.path.read_bytes()
                    roster = Roster.from_json(raw, source=str(self.path))
                    self._roster, self._raw, self._stamp = roster, raw, stamp
                    self._check_succession(roster)
            except (OSError, PkiError) as exc:
                reason = (
                    str(exc)
                    if isinstance(exc, PkiError)
                    else f"cannot read roster {self.path}: {exc.strerror}"
                )
                if self._roster is None:
                    raise PkiError(reason) from None
                problem = f"{reason}; serving v{self._roster.version}, read before"
                if problem != self.problem:
                    self.problem = problem
                    log.error("%s", problem)
            return self._roster, self._raw

    def _check_succession(self, roster: Roster) -> None:
        """Against the last version read that silos would adopt (the first read counts as adopted), counting
        signers as silos do, and against the quorum floor silos hold a roster to by default."""
        before = self._adopted
        if before is None or before.digest() == roster.digest():
            self._adopted, self.problem = roster, ""
            try:
                _check_default_floor(roster)
            except PkiError as exc:
                self.problem = f"{self.path}: silos will neither pin nor adopt it: {exc}"
                log.error("%s", self.problem)
            return
        try:
            before.check_successor(roster, revocations=self.revocations)
            _check_default_floor(roster)
        except PkiError as exc:
            self.problem = (
                f"{self.path} now holds roster v{roster.version}, which silos holding v{before.version} will "
                f"not adopt: {exc}. Members it adds or re-certifies will be refused by those silos; collect "
                "the signatures (python -m silo roster sign), check them (python -m aggregator roster check) "
                "and replace the file again"
            )
            log.error("%s", self.problem)
            return
        log.warning(
            "roster v%d (%s…) is in force, signed by a quorum of v%d's silos; silos adopt it at their next "
            "heartbeat",
            roster.version,
            roster.digest()[:16],
            before.version,
        )
        self._adopted, self.problem = roster, ""


def _check_default_floor(roster: Roster) -> None:
    try:
        roster.check_quorum(above=DEFAULT_QUORUM_ABOVE)
    except PkiError as exc:
        raise PkiError(
            f"{exc}, as silos' policy.roster_quorum_above asks by default; draft it again with --quorum "
            f"{minimum_quorum(len(roster.silo_ids), DEFAULT_QUORUM_ABOVE)} or more"
        ) from None


class _NothingRevoked:
    def is_revoked(self, cert: x509.Certificate) -> bool:
        return False


_NOTHING_REVOKED = _NothingRevoked()


def _order(member: Member) -> tuple[int, str]:
    return ROLES.index(member.role) if member.role in ROLES else len(ROLES), member.id


def _listed_twice(members: list[tuple[Member, x509.Certificate]]) -> list[str]:
    """One certificate (or one key under two certificates) listed under two ids would vote twice."""
    problems = []
    seen: dict[tuple[str, bytes], str] = {}
    for member, cert in members:
        der = cert.public_bytes(serialization.Encoding.DER)
        key = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        for what, value in (("certificate", der), ("public key", key)):
            first = seen.setdefault((what, value), member.id)
            if first != member.id:
                problems.append(f"{first} and {member.id} are listed with the same {what}")
                break
    return problems


def _cannot_vote(cert: x509.Certificate, revocations: Revocations) -> str:
    """Why a pinned certificate's signature does not count ("" if it does)."""
    if revocations.is_revoked(cert):
        return f"its {describe(cert)} has been revoked"
    try:
        check_valid_now(cert)
    except PkiError as exc:
        return f"its {exc}"
    return ""


def default_quorum(silos: int) -> int:
    """More than two thirds of the silos (at least one): it passes any floor a silo sets up to 2/3."""
    return max(1, 2 * silos // 3 + 1)


def minimum_quorum(silos: int, above: Fraction) -> int:
    """The least quorum that is above the fraction `above` of `silos` silos."""
    return int(above * silos) + 1


def draft(
    consortium: str,
    *,
    aggregator: bytes,
    silos: Iterable[tuple[str, bytes]],
    quorum: int = 0,
    previous: Roster | None = None,
) -> Roster:
    """An unsigned roster; `quorum` 0 means `default_quorum`: more than two thirds of the silo members.

    After `previous` the version is the next one, and the new roster must be signed by a quorum of the
    previous one's silos before silos adopt it.
    """
    members = [Member(AGGREGATOR, AGGREGATOR, aggregator)]
    members += [Member(silo_id, SILO, pem) for silo_id, pem in silos]
    n = len(members) - 1
    return Roster(
        consortium,
        previous.version + 1 if previous else 1,
        quorum or default_quorum(n),
        tuple(members),
    )
