"""This silo's part in one round's secure sums: the phase's census when one is due, then the contribution.

Each directive the aggregator sends (`SecAggStep`) starts the silo's next protocol stage; the silo answers
with one call. Anything that breaks the protocol or this silo's policy raises `SecAggError`, and the agent
then drops the round: a silo aborts rather than continue on a view it cannot trust.

What the silo enforces here, whatever the aggregator says: every session meets its `SessionPolicy`; per-class
rows leave only in a sum over exactly the phase's census set, and only if that set is still whole when the
silo signs (`tail_guard`); and it signs each round's contribution and each phase's census for one survivor set
only (`ReleaseLedger`).
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
from privacy.secagg import crypto, tail_guard, wire
from privacy.secagg.codec import FixedPointCodec
from privacy.secagg.policy import SessionPolicy
from privacy.secagg.protocol import Peers, ProtocolViolation, SecAggClient, Signer
from privacy.secagg.settings import SecAggSettings
from privacy.secagg.tail_guard import Census
from silo.releases import ReleaseLedger
from silo.upload import submit_stream

log = logging.getLogger("silo")

Upload = Callable[[Iterator[pb.SubmitRequest]], object]


def settings_of(spec: round_pb2.RoundSpec) -> SecAggSettings:
    return SecAggSettings(
        threshold=spec.secagg.threshold, neighbours=spec.secagg.neighbours, k_min=spec.secagg.k_min
    )


def census_of(spec: round_pb2.RoundSpec) -> Census | None:
    if not spec.HasField("census"):
        return None
    return Census.of(spec.census.silos, spec.census.silos_per_class)


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
        policy: SessionPolicy,
        ledger: ReleaseLedger,
        timeout: float,
    ) -> None:
        self.spec, self.schema, self.me = spec, schema, me
        self._sign, self._peers, self._policy, self._ledger = sign, peers, policy, ledger
        self._timeout = timeout
        self.settings = settings_of(spec)
        self.binding = hashlib.sha256(signed.spec).digest()
        self.codec = FixedPointCodec(schema, max_silos=len(spec.participants))  # refuses an overflow risk
        self.contribution = contribution
        self.phase = tail_guard.phase_key(spec.consortium_id, spec.config_sha256, spec.seed, schema.phase)
        self.release = crypto.transcript(
            spec.consortium_id, spec.state_digest, spec.config_sha256, str(spec.seed), str(spec.round)
        ).hex()
        self.guard_on = bool(schema.classes) and self.settings.k_min >= 2
        self.census = census_of(spec)
        if self.census is not None and me in self.census.silos:
            self._check_census_claim(self.census)
        self.purpose = ""
        self.client: SecAggClient | None = None
        self.words = np.zeros(0, dtype=np.uint64)
        self.released: frozenset[str] = frozenset()  # per-class rows went out for a sum over these silos
        self.done = False

    def _check_census_claim(self, census: Census) -> None:
        """The RoundSpec's census must be the one this silo took part in. A silo that signed the census but
        never received its result (the aggregator stopped in between) takes the counts the RoundSpec names,
        checked as a result would be: for the set it signed, counting its own classes."""
        kept = self._ledger.census(self.phase)
        if kept is None and self._ledger.survivors(self.census_release) == list(census.silos):
            counts = np.asarray(census.counts, dtype=np.uint64)
            tail_guard.check_census(
                counts, tail_guard.presence(self.schema, self.contribution), len(census.silos)
            )
            self._ledger.record_census(self.phase, census)
        elif kept != census:
            raise ProtocolViolation("the RoundSpec's census differs from the census this silo took part in")

    @property
    def census_release(self) -> str:
        return f"census/{self.phase}"

    def start(self, stub: consortium_pb2_grpc.ConsortiumServiceStub) -> None:
        participants = list(self.spec.participants)
        if self.guard_on and self.census is None:
            self._begin(stub, "census", participants, tail_guard.presence(self.schema, self.contribution))
        else:
            self._begin_contribution(stub, participants)

    def _begin_contribution(
        self, stub: consortium_pb2_grpc.ConsortiumServiceStub, participants: list[str]
    ) -> None:
        guarded = self.contribution
        if self.guard_on:
            census = self.census
            if census is None or self.me not in census.silos:
                zeroed = list(range(self.schema.classes))
            else:
                zeroed = census.guarded(participants, self.settings.k_min)
            if len(zeroed) < self.schema.classes:
                self.released = frozenset(participants)
            if zeroed:
                log.info("%s: tail guard zeroes classes %s", self.spec.round_id, zeroed)
            guarded = tail_guard.zero_classes(self.schema, self.contribution, zeroed)
        self._begin(stub, "contribution", participants, self.codec.encode(guarded))

    def _begin(
        self,
        stub: consortium_pb2_grpc.ConsortiumServiceStub,
        purpose: str,
        silos: list[str],
        words: np.ndarray,
    ) -> None:
        binding = self.binding
        if purpose == "contribution" and self.census is not None:
            binding = self.census.binding(binding)
        session = self.settings.session(self.spec.round_id, purpose, silos, len(words), binding)
        self._policy.check(session)
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
        log.debug("%s: %s sum started with %d silos", self.spec.round_id, purpose, len(session.participants))

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
            self._sign_survivors(stub, list(step.survivors.survivors))
        elif kind == "signatures":
            reveal = self.client.unmask(wire.signatures_from_pb(step.signatures))
            stub.Unmask(wire.reveal_to_pb(round_id, self.purpose, reveal), timeout=self._timeout)
            self.done = self.purpose == "contribution"
        elif kind == "census":
            self._after_census(stub, np.asarray(step.census.silos_per_class, dtype=np.uint64))
        else:
            raise ProtocolViolation(f"unknown secure-aggregation step {kind!r}")

    def _sign_survivors(self, stub: consortium_pb2_grpc.ConsortiumServiceStub, survivors: list[str]) -> None:
        """Consistency: only a survivor set this silo may release to, and only one per round or census."""
        if self.released and set(survivors) != self.released:
            raise ProtocolViolation(
                "per-class rows are summed only over the whole census set, and some of it left: "
                f"{', '.join(sorted(self.released - set(survivors)))}"
            )
        if self.purpose == "census":
            self._ledger.pin_survivors(self.census_release, survivors, "census of this phase")
        else:
            self._ledger.pin_survivors(
                f"round/{self.release}", survivors, f"contribution of round {self.spec.round}"
            )
        signature = self.client.consistency(survivors)
        request = pb.ConsistencyRequest(
            round_id=self.spec.round_id, sum=wire.SUM_OF_PURPOSE[self.purpose], signature=signature
        )
        stub.Consistency(request, timeout=self._timeout)

    def _after_census(self, stub: consortium_pb2_grpc.ConsortiumServiceStub, counts: np.ndarray) -> None:
        """Keep the phase's census, then start the contribution, guarded by it."""
        counted = self.client.survivors
        tail_guard.check_census(counts, tail_guard.presence(self.schema, self.contribution), len(counted))
        self.census = Census.of(counted, counts)
        self._ledger.record_census(self.phase, self.census)
        log.info(
            "%s: census of %d silos taken for this phase; classes held by fewer than %d: %s",
            self.spec.round_id,
            len(counted),
            self.settings.k_min,
            tail_guard.held_back(counts, self.settings.k_min),
        )
        self._begin_contribution(stub, list(counted))
