"""Protocol messages to and from their Protobuf form (fedlt/v1), for the silo agent and the aggregator."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fedlt.v1 import consortium_pb2 as pb
from privacy.secagg.protocol import AdvertisedKeys, Envelope, Inbox, Reveal

SUM_OF_PURPOSE = {"census": pb.SECURE_SUM_CENSUS, "contribution": pb.SECURE_SUM_CONTRIBUTION}
PURPOSE_OF_SUM = {v: k for k, v in SUM_OF_PURPOSE.items()}


def keys_to_pb(keys: AdvertisedKeys) -> pb.AdvertisedKeys:
    return pb.AdvertisedKeys(
        silo_id=keys.silo,
        c_public_key=keys.c_public,
        s_public_key=keys.s_public,
        signature=keys.signature,
        certificate=keys.credential,
    )


def keys_from_pb(keys: pb.AdvertisedKeys) -> AdvertisedKeys:
    return AdvertisedKeys(
        keys.silo_id, keys.c_public_key, keys.s_public_key, keys.signature, keys.certificate
    )


def envelopes_to_pb(envelopes: Iterable[Envelope]) -> list[pb.EncryptedShare]:
    return [
        pb.EncryptedShare(sender=e.sender, recipient=e.recipient, ciphertext=e.ciphertext) for e in envelopes
    ]


def envelopes_from_pb(shares: Iterable[pb.EncryptedShare]) -> tuple[Envelope, ...]:
    return tuple(Envelope(s.sender, s.recipient, s.ciphertext) for s in shares)


def inbox_to_pb(inbox: Inbox) -> pb.ShareInbox:
    return pb.ShareInbox(survivors=inbox.survivors, shares=envelopes_to_pb(inbox.envelopes))


def inbox_from_pb(inbox: pb.ShareInbox) -> Inbox:
    return Inbox(tuple(inbox.survivors), envelopes_from_pb(inbox.shares))


def signatures_to_pb(signatures: Mapping[str, bytes]) -> pb.ConsistencySignatures:
    return pb.ConsistencySignatures(
        signatures=[pb.SiloSignature(silo_id=s, signature=sig) for s, sig in signatures.items()]
    )


def signatures_from_pb(signatures: pb.ConsistencySignatures) -> dict[str, bytes]:
    return {s.silo_id: s.signature for s in signatures.signatures}


def reveal_to_pb(round_id: str, purpose: str, reveal: Reveal) -> pb.UnmaskRequest:
    def shares(by_owner: Mapping[str, bytes]) -> list[pb.RevealedShare]:
        return [pb.RevealedShare(owner=o, share=s) for o, s in sorted(by_owner.items())]

    return pb.UnmaskRequest(
        round_id=round_id,
        sum=SUM_OF_PURPOSE[purpose],
        self_mask_shares=shares(reveal.self_mask),
        mask_key_shares=shares(reveal.mask_key),
    )


def reveal_from_pb(request: pb.UnmaskRequest) -> Reveal:
    return Reveal(
        {s.owner: s.share for s in request.self_mask_shares},
        {s.owner: s.share for s in request.mask_key_shares},
    )
