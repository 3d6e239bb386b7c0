"""This silo's part in one round's sums, over whichever layer the RoundSpec names and this silo implements.

The sums themselves (census, tail guard, contribution) are `fedlt.aggregation.round_sums.SiloRound`, the same
code the simulator runs; the layer's half is this silo's `SiloSide` for it (keys, peers, session policy). What
this module adds is what a consortium silo must enforce and remember across restarts, whatever the aggregator
says (`ReleaseLedger`): the census named in a RoundSpec must be the one this silo took part in; a census it
takes is kept; and it releases each round's contribution and each phase's census for one set of silos only.
Messages go out through `privacy.wire.send`; steps come in as `SumStep`s.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable

import grpc
import numpy as np
import torch

from fedlt.aggregation import tail_guard
from fedlt.aggregation.halves import ReleaseNoise, SiloSide
from fedlt.aggregation.round_sums import SiloRound
from fedlt.aggregation.tail_guard import Census, CensusError
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy import roundspec
from privacy.wire import fetched, send, step_from_pb
from silo.releases import ReleaseLedger

log = logging.getLogger("silo")


def round_key(spec: round_pb2.RoundSpec) -> str:
    """One round of one run, whatever the attempt: what a silo trains on, and so releases, is fixed by it."""
    computed = [spec.consortium_id, spec.state_digest, spec.config_sha256, spec.seed, spec.round]
    return hashlib.sha256(json.dumps(computed).encode()).hexdigest()


class Participation:
    def __init__(
        self,
        signed: round_pb2.SignedRoundSpec,
        spec: round_pb2.RoundSpec,
        contribution: torch.Tensor,
        *,
        me: str,
        side: SiloSide,
        ledger: ReleaseLedger,
        stub,
        timeout: float,
        on_sent: Callable[[str, object], None],
        noise: ReleaseNoise | None = None,
    ) -> None:
        self.spec, self.me, self._ledger = spec, me, ledger
        self._stub, self._timeout, self._on_sent = stub, timeout, on_sent
        self._unsent: list[tuple[str, object]] = []  # of the last `_send`, until each is delivered
        sums = roundspec.sums_of(signed, spec)
        self.phase = tail_guard.phase_key(
            spec.consortium_id, spec.config_sha256, spec.seed, sums.schema.phase
        )
        self._releases = {"census": f"census/{self.phase}", "contribution": f"round/{round_key(spec)}"}
        if sums.census is not None and me in sums.census.silos:
            self._check_census_claim(sums, sums.census, contribution)
        self.sums = SiloRound(
            side,
            sums,
            contribution,
            me=me,
            on_census=lambda census: ledger.record_census(self.phase, census),
            on_release=self._pin,
            noise=noise,
        )

    @property
    def purpose(self) -> str:
        return self.sums.purpose

    @property
    def done(self) -> bool:
        return self.sums.done

    def start(self) -> None:
        self._send(self.sums.start())

    def step(self, step: pb.SumStep) -> None:
        purpose, decoded = step_from_pb(step)
        decoded = fetched(self._stub, self.spec.round_id, purpose, decoded, timeout=self._timeout)
        self._send(self.sums.step(purpose, decoded))

    def _send(self, outgoing: list[tuple[str, object]]) -> None:
        self._unsent = list(outgoing)
        while self._unsent:
            purpose, message = self._unsent[0]
            send(self._stub, self.spec.round_id, purpose, message, timeout=self._timeout)
            del self._unsent[0]
            self._on_sent(purpose, message)

    def resume(self, stub) -> None:
        """After a reconnect, with the new session's stub: send again what the lost connection may not have
        delivered (the same bytes: the aggregator takes a message it already holds as it is). A refusal
        because the sum has moved past that stage means it had arrived."""
        self._stub = stub
        unsent, self._unsent = self._unsent, []
        for purpose, message in unsent:
            try:
                send(stub, self.spec.round_id, purpose, message, timeout=self._timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                what = type(message).__name__
                log.info("%s: its %s had arrived before the reconnect", self.spec.round_id, what)
                continue
            self._on_sent(purpose, message)

    def _pin(self, purpose: str, survivors: tuple[str, ...]) -> None:
        what = "census of this phase" if purpose == "census" else f"contribution of round {self.spec.round}"
        self._ledger.pin_survivors(self._releases[purpose], survivors, what)

    def _check_census_claim(self, sums, census: Census, contribution: torch.Tensor) -> None:
        """The RoundSpec's census must be the one this silo took part in. A silo that signed the census but
        never received its result (the aggregator stopped in between) takes the counts the RoundSpec names,
        checked as a result would be: for the set it signed, counting its own classes."""
        kept = self._ledger.census(self.phase)
        if kept is None and self._ledger.survivors(self._releases["census"]) == list(census.silos):
            counts = np.asarray(census.counts, dtype=np.uint64)
            tail_guard.check_census(counts, tail_guard.presence(sums.schema, contribution), len(census.silos))
            self._ledger.record_census(self.phase, census)
        elif kept != census:
            raise CensusError("the RoundSpec's census differs from the census this silo took part in")
