"""This silo's part in the key service, for each layer its policy lists that asks for one (ckks, today).

A layer asks for the key service in its record (`fedlt.aggregation.registry.KeyKind`); this module names no
layer. Each such layer's keys live in `state_dir/<layer>/` (0700), each secret in a 0600 file named by its
id (`Keyring`). The silo has one X25519 enrollment key for the key service, made once and announced at
registration; it lives in the directory of the first of those layers its policy lists (one that already
holds it, if any). The key holder (the silo the aggregator names, which must also be the one the RoundSpec
names) makes the consortium's key once (`python -m silo keys rotate` makes a new one) and seals it to every
silo that announced an enrollment key the roster vouches for (`privacy.keyservice.ceremony`); every other
silo fetches the envelope addressed to it when a RoundSpec names a key it lacks. A silo without the key the
RoundSpec names refuses the round.

`KeyService` is what the agent's parts call: the enrollment it registers with, the key holder's share at
registration and at each heartbeat, the key a RoundSpec names fetched once the RoundSpec is opened and before
it is checked (`silo.admission`), and the key a round's side encrypts, decrypts and seals states with. Every
call to the aggregator goes through the session's transport (`silo.transport`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedlt.aggregation import record
from fedlt.aggregation.halves import SettingsRefused, Signer
from fedlt.aggregation.registry import KeyKind, SharedSecret
from fedlt.atomic import atomic_write, atomic_write_text
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.keyservice.ceremony import CeremonyError, announce, check_announcement, open_sealed, seal
from privacy.keyservice.wire import enrollment_from_pb, sealed_from_pb, sealed_to_pb
from privacy.pki.identity import MemberTrust
from silo.transport import SiloTransport
from silo.trust import SiloTrust

log = logging.getLogger("silo")

ENROLLMENT = "enrollment.key"


class MissingKey(SettingsRefused):
    """A round names a key this silo does not hold."""


class Keyring:
    """One layer's keys at this silo: the consortium's keys it holds, by id, and (as key holder) the one it
    made and shares now (`current`)."""

    def __init__(self, state_dir: Path, layer: str, kind: KeyKind) -> None:
        self.layer, self.kind = layer, kind
        self.dir = state_dir / layer
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._keys: dict[str, SharedSecret] = {}
        self._sealed_to: set[tuple[str, str]] = set()  # (context id, silo) shared through this aggregator

    def get(self, context_id: str) -> SharedSecret | None:
        if context_id not in self._keys:
            path = self.dir / f"{context_id}.secret"
            if not context_id.isalnum() or not path.exists():
                return None
            self._keys[context_id] = self.kind.from_secret_bytes(path.read_bytes())
        return self._keys[context_id]

    def held(self) -> list[SharedSecret]:
        """Every key this silo holds, the current one and those from before rotations."""
        return [self.get(path.stem) for path in sorted(self.dir.glob("*.secret"))]

    def secret_for(self, parameters: object) -> SharedSecret:
        """The key a round's signed parameters name (`parameters.context_id`)."""
        secret = self.get(parameters.context_id)
        if secret is None:
            raise MissingKey(
                f"this silo does not hold the {self.layer} key {parameters.context_id[:16]} the round names"
            )
        return secret

    def keep(self, secret: SharedSecret) -> None:
        atomic_write(self.dir / f"{secret.context_id}.secret", lambda fh: fh.write(secret.secret_bytes()))
        self._keys[secret.context_id] = secret

    # --- the key holder -----------------------------------------------------------------------------------

    def current(self) -> SharedSecret:
        """The key this silo made and shares as key holder: made on first use, replaced by `rotate`."""
        path = self.dir / "current"
        secret = self.get(path.read_text().strip()) if path.exists() else None
        return secret or self.rotate()

    def rotate(self) -> SharedSecret:
        secret = self.kind.new()
        self.keep(secret)
        atomic_write_text(self.dir / "current", secret.context_id)
        log.info("made %s key %s as the consortium's key holder", self.layer, secret.context_id[:16])
        return secret

    def share(
        self,
        transport: SiloTransport,
        *,
        consortium: str,
        me: str,
        sign: Signer,
        members: MemberTrust,
        again: bool = True,
    ) -> None:
        """Seal the current key to every silo whose announced enrollment key the roster vouches for (with
        `again` False, only to silos it was not yet sealed to: silos enroll while the consortium gathers)."""
        secret = self.current()
        if again:
            self._sealed_to.clear()
        sealed, recipients = [], []
        for enrollment in transport.enrollments():
            announcement = enrollment_from_pb(enrollment)
            if announcement.silo == me or (secret.context_id, announcement.silo) in self._sealed_to:
                continue
            try:
                check_announcement(announcement, consortium, members)
            except CeremonyError as exc:
                log.warning("not sealing the %s key: %s", self.layer, exc)
                continue
            recipients.append(announcement.silo)
            sealed.append(
                sealed_to_pb(
                    seal(
                        secret,
                        consortium=consortium,
                        layer=self.layer,
                        sender=me,
                        recipient=announcement,
                        sign=sign,
                    )
                )
            )
        if not again and not sealed:
            return
        transport.share_key(context_id=secret.context_id, public_key=secret.public_bytes(), sealed=sealed)
        self._sealed_to.update((secret.context_id, silo) for silo in recipients)
        log.info("shared %s key %s, sealed to %d silos", self.layer, secret.context_id[:16], len(sealed))

    # --- every other silo ---------------------------------------------------------------------------------

    def fetch(
        self,
        transport: SiloTransport,
        parameters: object,
        *,
        consortium: str,
        me: str,
        enrollment: X25519PrivateKey,
        members: MemberTrust,
    ) -> None:
        """Fetch and open the key `parameters` name (`context_id`), sealed to this silo's `enrollment` key by
        the key holder they name (`key_holder`)."""
        reply = transport.fetch_key(parameters.context_id)
        secret = open_sealed(
            sealed_from_pb(reply.sealed),
            consortium=consortium,
            layer=self.layer,
            me=me,
            enrollment=enrollment,
            holder=parameters.key_holder,
            holder_certificate=reply.holder_certificate,
            members=members,
            read=self.kind.from_secret_bytes,
        )
        if secret.context_id != parameters.context_id:
            raise CeremonyError("the key holder sealed another key than the round names")
        self.keep(secret)
        log.info("received %s key %s from %s", self.layer, secret.context_id[:16], parameters.key_holder)


def keyrings(state_dir: Path, privacy: tuple[str, ...]) -> dict[str, Keyring]:
    """A keyring for each layer `privacy` (the policy) lists that asks for the key service, in its order: no
    other silo makes, announces or fetches keys."""
    found = {}
    for name in privacy:
        kind = record(name).key_service
        if kind is not None:
            found[name] = Keyring(state_dir, name, kind)
    return found


class KeyService:
    """The key service as the agent uses it. `trust` gives the consortium and the roster's members as they
    are now; `sign` is the silo's certificate key."""

    def __init__(self, state_dir: Path, privacy: tuple[str, ...], *, trust: SiloTrust, sign: Signer) -> None:
        self.keyrings: Mapping[str, Keyring] = keyrings(state_dir, privacy)
        self._trust, self._sign = trust, sign
        self.me = ""  # the id the aggregator registered this silo under
        self._holding: Keyring | None = None  # whose key this silo makes and shares, as key holder

    def _enrollment_key(self) -> X25519PrivateKey:
        candidates = [keyring.dir / ENROLLMENT for keyring in self.keyrings.values()]
        path = next((p for p in candidates if p.exists()), candidates[0])
        if not path.exists():
            raw = X25519PrivateKey.generate().private_bytes_raw()
            atomic_write(path, lambda fh: fh.write(raw))  # mkstemp: mode 0600
        return X25519PrivateKey.from_private_bytes(path.read_bytes())

    def enrollment(self, me: str) -> pb.KeyEnrollment | None:
        """What this silo registers with: its enrollment key, signed (None if no layer it runs has a key
        service)."""
        if not self.keyrings:
            return None
        announcement = announce(self._trust.roster.consortium, me, self._enrollment_key(), self._sign)
        return pb.KeyEnrollment(public_key=announcement.public, signature=announcement.signature)

    def registered(self, transport: SiloTransport, reply: pb.RegisterResponse) -> None:
        """After registering: as the key holder the aggregator names, seal the key to every silo enrolled."""
        self.me = reply.silo_id
        keyring = self.keyrings.get(reply.key_layer)
        self._holding = keyring if keyring is not None and reply.key_holder == self.me else None
        if self._holding is not None:
            self._share(transport, self._holding)

    def heartbeat(self, transport: SiloTransport) -> None:
        """As the key holder: seal the key to silos enrolled since it last did."""
        if self._holding is not None:
            self._share(transport, self._holding, again=False)

    def before_round(self, transport: SiloTransport, spec: round_pb2.RoundSpec, parameters: object) -> None:
        """Before checking a RoundSpec (opened, its signature verified) of a layer with a key service (one of
        `keyrings`: admission asks for no other): fetch the key its `parameters` name if this silo lacks it
        (or, as its key holder, seal it to newcomers). A key that does not arrive makes the check refuse the
        round; so do parameters that do not read back (None)."""
        keyring = self.keyrings[spec.privacy]
        if parameters is None:
            return
        try:
            if parameters.key_holder == self.me:
                self._share(transport, keyring)
            elif keyring.get(parameters.context_id) is None:
                keyring.fetch(
                    transport,
                    parameters,
                    consortium=self._trust.roster.consortium,
                    me=self.me,
                    enrollment=self._enrollment_key(),
                    members=self._trust.members,
                )
        except CeremonyError as exc:
            log.error("%s: the %s key: %s", spec.round_id, spec.privacy, exc)
        except grpc.RpcError as exc:
            log.warning("%s: the %s key could not be fetched: %s", spec.round_id, spec.privacy, exc.details())

    def _share(self, transport: SiloTransport, keyring: Keyring, *, again: bool = True) -> None:
        keyring.share(
            transport,
            consortium=self._trust.roster.consortium,
            me=self.me,
            sign=self._sign,
            members=self._trust.members,
            again=again,
        )

    def secret_for(self, layer: str) -> Callable[[object], SharedSecret] | None:
        """What `layer`'s silo side reads its key with, from a round's parameters (None: it has no key)."""
        keyring = self.keyrings.get(layer)
        return None if keyring is None else keyring.secret_for

    def secret(self, layer: str, parameters: object) -> SharedSecret:
        """The key a round of `layer` names in its `parameters` (as signed, `RoundSums.settings`), which seals
        the state where silos step the model."""
        keyring = self.keyrings.get(layer)
        if keyring is None:
            raise MissingKey(f"privacy layer {layer!r} has no key service to seal its states with")
        return keyring.secret_for(parameters)

    def held(self, layer: str) -> list[SharedSecret]:
        """Every key of `layer` this silo holds (older ones open states sealed before a rotation)."""
        keyring = self.keyrings.get(layer)
        return [] if keyring is None else keyring.held()
