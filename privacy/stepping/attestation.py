"""Signed state digests: a silo steps from a sealed state only if every silo its sum counted computed it.

When silos step the model (under ckks), any silo holding the consortium's key can seal any state under any
digest (`sealed_state`), so the seal alone says only that *some* key holder made it. Each silo that steps
therefore signs, with its consortium certificate key, the consortium, the round, the digest of the state it
computed and the silos counted by the sum it stepped from (`attest`); the aggregator keeps the signatures
with the sealed state (`aggregator.held_state`) and the next RoundSpec carries them (`RoundSpec.attestations`,
with each signer's certificate as TLS verified it). Before stepping from or training on that state a silo
checks them itself (`check_attested`): every silo of the counted set signed exactly that digest for that
round, each is a member of its roster (its `peers`), and the set is at least its own floor. A state one silo
computed alone, or one the counted silos did not all reach, is refused. Round 1's seeded initial state is
public and checked against the seed instead (`silo.stepping.opened_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fedlt.aggregation.halves import BadMessage, Peers
from fedlt.errors import FedltError
from fedlt.v1 import round_pb2
from privacy.crypto import transcript
from privacy.peers import ConsortiumPeers, Signed
from privacy.pki.identity import MemberTrust

# named for ckks, the first layer to use them: domain separators, so new names would void every signed state
ATTESTATION_CONTEXT = "fedlt/ckks/state-attestation/v1"


class NotAttested(BadMessage):
    """A sealed state not signed by every silo its sum counted: this silo will not step from it."""


# one silo's signature over a state it computed, and its certificate (PEM) for peers to check: the same pair
# as a consistency signature of a sum
Attestation = Signed


@dataclass(frozen=True)
class Attested:
    """A state's signatures: the silos the sum it was stepped from counted (sorted), and each one's."""

    counted: tuple[str, ...]
    by_silo: Mapping[str, Attestation]

    def to_pb(self) -> round_pb2.StateAttestations:
        return round_pb2.StateAttestations(
            counted=self.counted,
            signatures=[
                round_pb2.StateSignature(silo_id=s, signature=a.signature, certificate=a.certificate)
                for s, a in sorted(self.by_silo.items())
            ],
        )

    @classmethod
    def from_pb(cls, attestations: round_pb2.StateAttestations) -> Attested:
        by_silo = {s.silo_id: Attestation(s.signature, s.certificate) for s in attestations.signatures}
        if len(by_silo) != len(attestations.signatures):
            raise NotAttested("a state attested twice by one silo")
        return cls(tuple(attestations.counted), by_silo)


def state_message(
    consortium: str,
    round_number: int,
    digest: str,
    counted: Sequence[str],
    readers: Sequence[str] | None = None,
) -> bytes:
    """What a silo signs of a state: the consortium, the round, the digest, the silos the sum counted and,
    where fewer read it (blind: a silo lost after its masked input is counted but handed nothing), who did:
    every signer names every other, so no signature can be dropped from the set unnoticed."""
    parts = [consortium, str(round_number), digest, *counted]
    if readers is not None and tuple(readers) != tuple(counted):
        parts += ["read by", *readers]
    return transcript("fedlt/ckks/state/v1", *parts)


def attest(
    sign: Callable[..., bytes],
    *,
    consortium: str,
    round_number: int,
    digest: str,
    counted: Sequence[str],
    readers: Sequence[str] | None = None,
) -> bytes:
    """This silo's signature over the state of `round_number` it stepped to from a sum counting `counted`
    and read by `readers` (None: by every counted silo)."""
    message = state_message(consortium, round_number, digest, counted, readers)
    return sign(message, context=ATTESTATION_CONTEXT)


def check_signed(
    peers: Peers,
    silo: str,
    attestation: Attestation,
    *,
    consortium: str,
    round_number: int,
    digest: str,
    counted: Sequence[str],
    readers: Sequence[str] | None = None,
) -> None:
    """`silo`'s signature over that state, by a member `peers` accepts; NotAttested otherwise."""
    message = state_message(consortium, round_number, digest, counted, readers)
    try:
        peers.verify(
            silo, attestation.certificate, attestation.signature, message, context=ATTESTATION_CONTEXT
        )
    except FedltError as exc:
        raise NotAttested(f"{silo} did not sign state {digest[:16]} of round {round_number}: {exc}") from None


def check_report(
    members: MemberTrust,
    silo: str,
    attestation: Attestation,
    *,
    consortium: str,
    round_number: int,
    digest: str,
    counted: Sequence[str],
    readers: Sequence[str] | None = None,
) -> None:
    """The aggregator's check of a state report's signature, against the certificate TLS verified and the
    roster: it keeps no state whose signatures the next round's silos would refuse."""
    check_signed(
        ConsortiumPeers(members),
        silo,
        attestation,
        consortium=consortium,
        round_number=round_number,
        digest=digest,
        counted=counted,
        readers=readers,
    )


def check_attested(
    attested: Attested,
    *,
    consortium: str,
    round_number: int,
    digest: str,
    peers: Peers,
    min_counted: int,
) -> None:
    """Every silo that read the sum signed `digest` for `round_number`, naming the counted set and the
    readers (the signers: every counted silo, or under blind those handed the total), and there are at least
    `min_counted` readers (the silo's floor); NotAttested otherwise."""
    counted = attested.counted
    if counted != tuple(sorted(set(counted))):
        raise NotAttested("the silos a state was stepped from are listed out of order or twice")
    if len(counted) < min_counted:
        raise NotAttested(
            f"state {digest[:16]} of round {round_number} was stepped from a sum of {len(counted)} silos, "
            f"fewer than this silo's floor of {min_counted}"
        )
    readers = tuple(sorted(attested.by_silo))
    missing = sorted(set(counted) - set(readers))
    strangers = sorted(set(readers) - set(counted))
    if strangers or len(readers) < min_counted:
        raise NotAttested(
            f"state {digest[:16]} of round {round_number} lacks the signatures of "
            f"{', '.join(missing) or 'none'} and carries those of silos its sum did not count: "
            f"{', '.join(strangers) or 'none'}"
        )
    for silo in readers:
        try:
            check_signed(
                peers,
                silo,
                attested.by_silo[silo],
                consortium=consortium,
                round_number=round_number,
                digest=digest,
                counted=counted,
                readers=readers,
            )
        except NotAttested:
            if not missing:
                raise
            raise NotAttested(
                f"state {digest[:16]} of round {round_number} lacks the signatures of {', '.join(missing)}: "
                f"{silo} signed it as read by others than those whose signatures it carries"
            ) from None
