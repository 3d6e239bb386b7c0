"""This silo's CKKS keys: its enrollment key, the consortium's secret contexts it holds, and the ceremony.

Everything lives in `state_dir/ckks/` (0700), each secret in a 0600 file: the X25519 enrollment key, made
once, and each secret context by its id. The key holder (the silo the aggregator names, which must also be the
one the RoundSpec names) makes the consortium's key once (`rotate` makes a new one) and seals it to every silo
that announced an enrollment key the roster vouches for; every other silo fetches the envelope addressed to it
when a RoundSpec names a key it lacks. A silo without the key the RoundSpec names refuses the round.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedlt.aggregation.halves import SettingsRefused
from fedlt.atomic import atomic_write, atomic_write_text
from fedlt.v1 import consortium_pb2 as pb
from privacy.ckks.ceremony import CeremonyError, announce, check_announcement, open_sealed, seal
from privacy.ckks.keys import SecretContext
from privacy.ckks.settings import CkksParameters
from privacy.ckks.wire import enrollment_from_pb, sealed_from_pb, sealed_to_pb
from privacy.pki.trust import MemberTrust

log = logging.getLogger("silo")


class MissingKey(SettingsRefused):
    """A round names a CKKS key this silo does not hold."""


class CkksKeyring:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "ckks"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._contexts: dict[str, SecretContext] = {}
        self._sealed_to: set[tuple[str, str]] = set()  # (context id, silo) shared through this aggregator

    @classmethod
    def for_policy(cls, state_dir: Path, privacy: tuple[str, ...]) -> CkksKeyring | None:
        """A keyring only for a silo whose policy accepts ckks: no other silo makes or announces keys."""
        return cls(state_dir) if "ckks" in privacy else None

    def enrollment(self) -> X25519PrivateKey:
        path = self.dir / "enrollment.key"
        if not path.exists():
            raw = X25519PrivateKey.generate().private_bytes_raw()
            atomic_write(path, lambda fh: fh.write(raw))  # mkstemp: mode 0600
        return X25519PrivateKey.from_private_bytes(path.read_bytes())

    def enrollment_pb(self, consortium: str, me: str, sign) -> pb.CkksEnrollment:
        announcement = announce(consortium, me, self.enrollment(), sign)
        return pb.CkksEnrollment(public_key=announcement.public, signature=announcement.signature)

    def get(self, context_id: str) -> SecretContext | None:
        if context_id not in self._contexts:
            path = self.dir / f"{context_id}.secret"
            if not context_id.isalnum() or not path.exists():
                return None
            self._contexts[context_id] = SecretContext.from_secret_bytes(path.read_bytes())
        return self._contexts[context_id]

    def held(self) -> list[SecretContext]:
        """Every key this silo holds, the current one and those from before rotations."""
        return [self.get(path.stem) for path in sorted(self.dir.glob("*.secret"))]

    def secret_for(self, parameters: CkksParameters) -> SecretContext:
        """What the ckks silo side encrypts and decrypts with: the key the signed parameters name."""
        secret = self.get(parameters.context_id)
        if secret is None:
            raise MissingKey(
                f"this silo does not hold the CKKS key {parameters.context_id[:16]} the round names"
            )
        return secret

    def _keep(self, secret: SecretContext) -> None:
        atomic_write(self.dir / f"{secret.context_id}.secret", lambda fh: fh.write(secret.secret_bytes()))
        self._contexts[secret.context_id] = secret

    # --- the key holder -----------------------------------------------------------------------------------

    def current(self) -> SecretContext:
        """The key this silo made and shares as key holder: made on first use, replaced by `rotate`."""
        path = self.dir / "current"
        secret = self.get(path.read_text().strip()) if path.exists() else None
        return secret or self.rotate()

    def rotate(self) -> SecretContext:
        secret = SecretContext.new()
        self._keep(secret)
        atomic_write_text(self.dir / "current", secret.context_id)
        log.info("made CKKS key %s as the consortium's key holder", secret.context_id[:16])
        return secret

    def share(
        self,
        stub,
        *,
        consortium: str,
        me: str,
        sign,
        members: MemberTrust,
        timeout: float,
        again: bool = True,
    ) -> None:
        """Seal the current key to every silo whose announced enrollment key the roster vouches for (with
        `again` False, only to silos it was not yet sealed to: silos enroll while the consortium gathers)."""
        secret = self.current()
        if again:
            self._sealed_to.clear()
        sealed, recipients = [], []
        for enrollment in stub.ListEnrollments(pb.ListEnrollmentsRequest(), timeout=timeout).enrollments:
            announcement = enrollment_from_pb(enrollment)
            if announcement.silo == me or (secret.context_id, announcement.silo) in self._sealed_to:
                continue
            try:
                check_announcement(announcement, consortium, members)
            except CeremonyError as exc:
                log.warning("not sealing the CKKS key: %s", exc)
                continue
            recipients.append(announcement.silo)
            sealed.append(
                sealed_to_pb(
                    seal(secret, consortium=consortium, sender=me, recipient=announcement, sign=sign)
                )
            )
        if not again and not sealed:
            return
        request = pb.ShareCkksContextRequest(
            context_id=secret.context_id, public_context=secret.public.serialized, sealed=sealed
        )
        stub.ShareCkksContext(request, timeout=timeout)
        self._sealed_to.update((secret.context_id, silo) for silo in recipients)
        log.info("shared CKKS key %s, sealed to %d silos", secret.context_id[:16], len(sealed))

    # --- every other silo ---------------------------------------------------------------------------------

    def fetch(
        self,
        stub,
        parameters: CkksParameters,
        *,
        consortium: str,
        me: str,
        members: MemberTrust,
        timeout: float,
    ) -> None:
        """Fetch and open the key `parameters` name, sealed to this silo by the named key holder."""
        reply = stub.FetchCkksContext(
            pb.FetchCkksContextRequest(context_id=parameters.context_id), timeout=timeout
        )
        secret = open_sealed(
            sealed_from_pb(reply.sealed),
            consortium=consortium,
            me=me,
            enrollment=self.enrollment(),
            holder=parameters.key_holder,
            holder_certificate=reply.holder_certificate,
            members=members,
        )
        if secret.context_id != parameters.context_id:
            raise CeremonyError("the key holder sealed another key than the round names")
        self._keep(secret)
        log.info("received CKKS key %s from %s", secret.context_id[:16], parameters.key_holder)
