"""The `secagg` layer's messages to and from their Protobuf form (fedlt/v1), for silo agent and aggregator.

A silo's messages each go out through their own RPC (`SENDERS`); the aggregator's stage outputs travel as
`SumStep`s (`STEP_ENCODERS`, `STEP_DECODERS`). A masked upload is the bytes of a ring vector (`ring.Ring`:
little-endian 64-bit words, then 32-bit ones); the aggregator checks its length against the sum's ring. In a
census, the masked input's signature rides in its Submit stream's header and the reveal's in its
UnmaskRequest; the census's transcript relays both to every silo.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import numpy as np

from fedlt.aggregation.registry import LayerWire
from fedlt.v1 import consortium_pb2 as pb
from fedlt.wire import SUM_OF_PURPOSE, Mapped, submit_stream
from privacy.peers import SIGNATURE_DRILL_NAMES, SIGNATURE_RECEIVERS, SIGNATURE_SENDERS
from privacy.secagg.protocol import (
    AdvertisedKeys,
    Envelope,
    Inbox,
    KeyList,
    MaskedInput,
    ProtocolViolation,
    Reveal,
    Shares,
    Signatures,
    SurvivorList,
    Transcript,
)

KEYS = Mapped(
    AdvertisedKeys,
    pb.AdvertisedKeys,
    {"silo": "silo_id", "c_public": "c_public_key", "s_public": "s_public_key", "credential": "certificate"},
)
ENVELOPE = Mapped(Envelope, pb.EncryptedShare)
keys_to_pb, keys_from_pb = KEYS.to_pb, KEYS.from_pb


def envelopes_to_pb(envelopes: Iterable[Envelope]) -> list[pb.EncryptedShare]:
    return [ENVELOPE.to_pb(e) for e in envelopes]


def envelopes_from_pb(shares: Iterable[pb.EncryptedShare]) -> tuple[Envelope, ...]:
    return tuple(ENVELOPE.from_pb(s) for s in shares)


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


def _shares_to_pb(by_owner: Mapping[str, bytes]) -> list[pb.RevealedShare]:
    return [pb.RevealedShare(owner=o, share=s) for o, s in sorted(by_owner.items())]


def reveal_to_pb(round_id: str, purpose: str, reveal: Reveal) -> pb.UnmaskRequest:
    return pb.UnmaskRequest(
        round_id=round_id,
        sum=SUM_OF_PURPOSE[purpose],
        self_mask_shares=_shares_to_pb(reveal.self_mask),
        mask_key_shares=_shares_to_pb(reveal.mask_key),
        signature=reveal.signature,
    )


def reveal_from_pb(request: pb.UnmaskRequest | pb.SignedReveal) -> Reveal:
    return Reveal(
        {s.owner: s.share for s in request.self_mask_shares},
        {s.owner: s.share for s in request.mask_key_shares},
        request.signature,
    )


def masked_payload(masked: MaskedInput) -> bytes:
    return masked.vector.tobytes()


def masked_of(payload: bytes) -> MaskedInput:
    return MaskedInput(np.frombuffer(payload, dtype=np.uint8))


def signed_by_header(masked: MaskedInput, header: pb.SubmitHeader) -> MaskedInput:
    """A masked input with the signature its Submit stream's header carries (a census's; empty otherwise)."""
    return replace(masked, signature=header.signature)


def transcript_to_pb(transcript: Transcript) -> pb.SecAggTranscript:
    return pb.SecAggTranscript(
        masked_inputs=[
            pb.SignedMaskedInput(silo_id=u, masked=masked_payload(m), signature=m.signature)
            for u, m in transcript.masked.items()
        ],
        reveals=[
            pb.SignedReveal(
                silo_id=u,
                self_mask_shares=_shares_to_pb(r.self_mask),
                mask_key_shares=_shares_to_pb(r.mask_key),
                signature=r.signature,
            )
            for u, r in transcript.reveals.items()
        ],
    )


def transcript_from_pb(transcript: pb.SecAggTranscript) -> Transcript:
    """The transcript as relayed; a silo listed twice is refused here (a dict would keep one silently)."""
    for listed in (transcript.masked_inputs, transcript.reveals):
        silos = [entry.silo_id for entry in listed]
        if len(set(silos)) != len(silos):
            raise ProtocolViolation("the census transcript lists a silo twice")
    return Transcript(
        {
            m.silo_id: MaskedInput(np.frombuffer(m.masked, dtype=np.uint8), m.signature)
            for m in transcript.masked_inputs
        },
        {r.silo_id: reveal_from_pb(r) for r in transcript.reveals},
    )


# --- the aggregator's stage outputs, as the fields of a SumStep ---------------------------------------------

STEP_ENCODERS: dict[type, Callable[[object], dict[str, object]]] = {
    KeyList: lambda step: {"keys": pb.KeyList(keys=[keys_to_pb(k) for k in step.keys])},
    Inbox: lambda step: {"inbox": inbox_to_pb(step)},
    SurvivorList: lambda step: {"survivors": pb.SurvivorList(survivors=step.survivors)},
    Signatures: lambda step: {"signatures": signatures_to_pb(step.by_silo)},
    Transcript: lambda step: {"transcript": transcript_to_pb(step)},
}

STEP_DECODERS: dict[str, Callable[[pb.SumStep], object]] = {
    "keys": lambda step: KeyList(tuple(keys_from_pb(k) for k in step.keys.keys)),
    "inbox": lambda step: inbox_from_pb(step.inbox),
    "survivors": lambda step: SurvivorList(tuple(step.survivors.survivors)),
    "signatures": lambda step: Signatures(signatures_from_pb(step.signatures)),
    "transcript": lambda step: transcript_from_pb(step.transcript),
}


# --- a silo's messages, each through its RPC ----------------------------------------------------------------

Send = Callable[[object, str, str, object, float], object]  # (stub, round_id, purpose, message, timeout)


def _advertise(stub, round_id: str, purpose: str, keys: AdvertisedKeys, timeout: float) -> object:
    request = pb.AdvertiseKeysRequest(
        round_id=round_id,
        sum=SUM_OF_PURPOSE[purpose],
        c_public_key=keys.c_public,
        s_public_key=keys.s_public,
        signature=keys.signature,
    )
    return stub.AdvertiseKeys(request, timeout=timeout)


def _share(stub, round_id: str, purpose: str, shares: Shares, timeout: float) -> object:
    request = pb.ShareKeysRequest(
        round_id=round_id, sum=SUM_OF_PURPOSE[purpose], shares=envelopes_to_pb(shares.envelopes)
    )
    return stub.ShareKeys(request, timeout=timeout)


def _submit_masked(stub, round_id: str, purpose: str, masked: MaskedInput, timeout: float) -> object:
    stream = submit_stream(
        round_id, masked_payload(masked), kind=pb.CONTRIBUTION_KIND_MASKED, purpose=purpose
    )
    first = next(stream)
    first.header.signature = masked.signature
    return stub.Submit(itertools.chain([first], stream), timeout=timeout)


def _unmask(stub, round_id: str, purpose: str, reveal: Reveal, timeout: float) -> object:
    return stub.Unmask(reveal_to_pb(round_id, purpose, reveal), timeout=timeout)


SENDERS: dict[type, Send] = {
    AdvertisedKeys: _advertise,
    Shares: _share,
    MaskedInput: _submit_masked,
    Reveal: _unmask,
    **SIGNATURE_SENDERS,
}


# the aggregator's reading of each RPC's request: (request, the caller's silo id, its certificate PEM)
def _advertised(request: pb.AdvertiseKeysRequest, silo: str, certificate: bytes) -> AdvertisedKeys:
    """The keys in the caller's name, with the certificate TLS verified attached for its peers to check."""
    return AdvertisedKeys(silo, request.c_public_key, request.s_public_key, request.signature, certificate)


RECEIVERS: dict[str, Callable[[object, str, bytes], object]] = {
    "AdvertiseKeys": _advertised,
    "ShareKeys": lambda request, *_: Shares(envelopes_from_pb(request.shares)),
    "Unmask": lambda request, *_: reveal_from_pb(request),
    **SIGNATURE_RECEIVERS,
}

# what operators call the messages in dropout drills (FEDLT_DRILL_STOP_AFTER)
DRILL_NAMES: dict[type, str] = {
    AdvertisedKeys: "keys",
    Shares: "shares",
    MaskedInput: "masked",
    Reveal: "unmask",
    **SIGNATURE_DRILL_NAMES,
}
# a Submit stream's kind: the upload it carries, and how to read it; what its header adds to it
UPLOADS = {pb.CONTRIBUTION_KIND_MASKED: (MaskedInput, masked_of)}
FROM_HEADER = {MaskedInput: signed_by_header}

WIRE = LayerWire(
    senders=SENDERS,
    step_encoders=STEP_ENCODERS,
    step_decoders=STEP_DECODERS,
    uploads=UPLOADS,
    from_header=FROM_HEADER,
    receivers=RECEIVERS,
    drill_names=DRILL_NAMES,
)
