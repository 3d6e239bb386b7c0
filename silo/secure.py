"""This silo's part in one round's secure sums: the census when the tail guard applies, then the contribution.

Each directive the aggregator sends (`SecAggStep`) starts the silo's next protocol stage; the silo answers
with one call. Anything that breaks the protocol raises `SecAggError`, and the agent then drops the round:
a silo aborts rather than continue on a view it cannot trust.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from fedlt.aggregation import Schema
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import consortium_pb2_grpc, round_pb2
from privacy.secagg import tail_guard, wire
from privacy.secagg.codec import FixedPointCodec
from privacy.secagg.protocol import Peers, ProtocolViolation, SecAggClient, Signer
from privacy.secagg.settings import SecAggSettings
from silo.upload import submit_stream

log = logging.getLogger("silo")

Upload = Callable[[Iterator[pb.SubmitRequest]], object]


class SecureRound:
    def __init__(
        self,
        signed: round_pb2.SignedRoundSpec,
        spec: round_pb2.RoundSpec,
        schema: Schema,
        contribution: torch.Tensor,
        *,
        me: str,
        sign: Signer,
        peers: Peers,
        timeout: float,
    ) -> None:
        self.spec, self.schema, self.me = spec, schema, me
        self._sign, self._peers, self._timeout = sign, peers, timeout
        self.settings = SecAggSettings(
            threshold=spec.secagg.threshold, neighbours=spec.secagg.neighbours, k_min=spec.secagg.k_min
        )
        self.binding = hashlib.sha256(signed.spec).digest()
        self.codec = FixedPointCodec(schema, max_silos=len(spec.participants))  # refuses an overflow risk
        self.contribution = contribution
        self.census_on = bool(schema.classes) and self.settings.k_min >= 2
        self.counted: frozenset[str] | None = None
        self.purpose = ""
        self.client: SecAggClient | None = None
        self.words = np.zeros(0, dtype=np.uint64)
        self.done = False

    def start(self, stub: consortium_pb2_grpc.ConsortiumServiceStub) -> None:
        if self.census_on:
            self._begin(
                stub,
                "census",
                list(self.spec.participants),
                tail_guard.presence(self.schema, self.contribution),
            )
        else:
            self._begin(
                stub, "contribution", list(self.spec.participants), self.codec.encode(self.contribution)
            )

    def _begin(
        self,
        stub: consortium_pb2_grpc.ConsortiumServiceStub,
        purpose: str,
        silos: list[str],
        words: np.ndarray,
    ) -> None:
        session = self.settings.session(self.spec.round_id, purpose, silos, len(words), self.binding)
        self.purpose, self.words = purpose, words
        self.client = SecAggClient(session, self.me, sign=self._sign, peers=self._peers)
        keys = self.client.advertise()
        stub.AdvertiseKeys(
            pb.AdvertiseKeysRequest(
                round_id=self.spec.round_id,
                sum=wire.SUM_OF_PURPOSE[purpose],
                c_public_key=keys.c_public,
                s_public_key=keys.s_public,
                signature=keys.signature,
            ),
            timeout=self._timeout,
        )
        log.debug("%s: %s sum started with %d silos", self.spec.round_id, purpose, len(silos))

    def step(
        self, stub: consortium_pb2_grpc.ConsortiumServiceStub, step: pb.SecAggStep, upload: Upload
    ) -> None:
        """Act on one stage's output; `upload` streams a masked input through Submit."""
        if wire.PURPOSE_OF_SUM.get(step.sum) != self.purpose or self.client is None:
            raise ProtocolViolation(f"a {step.sum} step arrived during the {self.purpose} sum")
        round_id, sum_ = self.spec.round_id, step.sum
        kind = step.WhichOneof("step")
        if kind == "keys":
            envelopes = self.client.share([wire.keys_from_pb(k) for k in step.keys.keys])
            request = pb.ShareKeysRequest(round_id=round_id, sum=sum_, shares=wire.envelopes_to_pb(envelopes))
            stub.ShareKeys(request, timeout=self._timeout)
        elif kind == "inbox":
            masked = self.client.masked_input(wire.inbox_from_pb(step.inbox), self.words)
            payload = np.ascontiguousarray(masked, dtype="<u8").tobytes()
            upload(submit_stream(round_id, payload, kind=pb.CONTRIBUTION_KIND_MASKED, secure_sum=sum_))
        elif kind == "survivors":
            survivors = list(step.survivors.survivors)
            if self.counted is not None and set(survivors) != self.counted:
                raise ProtocolViolation(
                    "the contribution's survivors differ from the silos the census counted"
                )
            signature = self.client.consistency(survivors)
            stub.Consistency(
                pb.ConsistencyRequest(round_id=round_id, sum=sum_, signature=signature), timeout=self._timeout
            )
        elif kind == "signatures":
            reveal = self.client.unmask(wire.signatures_from_pb(step.signatures))
            stub.Unmask(wire.reveal_to_pb(round_id, self.purpose, reveal), timeout=self._timeout)
            self.done = self.purpose == "contribution"
        elif kind == "census":
            self._after_census(stub, np.asarray(step.census.silos_per_class, dtype=np.uint64))
        else:
            raise ProtocolViolation(f"unknown secure-aggregation step {kind!r}")

    def _after_census(self, stub: consortium_pb2_grpc.ConsortiumServiceStub, counts: np.ndarray) -> None:
        """Zero the classes too few silos hold, then start the contribution among the silos counted."""
        counted = self.client.survivors
        mine = tail_guard.presence(self.schema, self.contribution)
        if len(counts) != self.schema.classes or (counts < mine).any() or (counts > len(counted)).any():
            raise ProtocolViolation("the census result cannot be the sum of the silos' presence")
        held = tail_guard.held_back(counts, self.settings.k_min)
        if held:
            log.info("%s: tail guard holds back classes %s", self.spec.round_id, held)
        self.counted = frozenset(counted)
        guarded = tail_guard.zero_classes(self.schema, self.contribution, held)
        self._begin(stub, "contribution", sorted(counted), self.codec.encode(guarded))
