"""This silo's part in one round's sums, over whichever layer the RoundSpec names and this silo implements.

The sums themselves (census, tail guard, contribution) are `fedlt.aggregation.round_sums.SiloRound`, the same
code the simulator runs, and every release in them passes the silo's release gate
(`fedlt.aggregation.gate.ReleaseGate`: roster, floors, the ledger keyed by what is released); the layer's half
is this silo's `SiloSide` for it (keys, peers, session policy). What this module adds is what a consortium
silo must remember across restarts (`ReleaseLedger`): the census named in a RoundSpec must be the one this
silo took part in, and a census it takes is kept. Messages go out through the session's transport
(`silo.transport`, which maps each to its RPC with `privacy.wire`); steps come in as `SumStep`s. The round's
sums are read from the RoundSpec once, by admission (`silo.admission`), and handed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
import numpy as np
import torch

from fedlt.aggregation import tail_guard
from fedlt.aggregation.gate import ReleaseGate, Subject
from fedlt.aggregation.halves import ReleaseNoise, SiloSide
from fedlt.aggregation.round_sums import RoundSums, SiloRound
from fedlt.aggregation.tail_guard import Census, CensusError
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.wire import step_from_pb
from silo.releases import ReleaseLedger
from silo.transport import SiloTransport

log = logging.getLogger("silo")


class Participation:
    def __init__(
        self,
        spec: round_pb2.RoundSpec,
        sums: RoundSums,
        contribution: torch.Tensor,
        *,
        me: str,
        side: SiloSide,
        gate: ReleaseGate,
        trained_from: str,
        data: str = "",
        ledger: ReleaseLedger,
        transport: SiloTransport,
        on_sent: Callable[[str, object], None],
        noise: ReleaseNoise | None = None,
        records: np.ndarray | None = None,
        class_names: Sequence[str] | None = None,
    ) -> None:
        """`sums` are the round's as `spec` signs them (`privacy.roundspec.sums_of`). `trained_from` is the
        content digest of the state the contribution was computed from (checked against the signed digest by
        the caller) and `data` the digest of the prepared data it was trained on (`gate.data_digest`): the
        ledger's key for it. `records`: this silo's record count per class, for the census's record floor;
        `class_names` the plan's, by which the census is keyed."""
        self.spec, self.me, self._ledger = spec, me, ledger
        self._transport, self._on_sent = transport, on_sent
        self._unsent: list[tuple[str, object]] = []  # of the last `_send`, until each is delivered
        self.sums = SiloRound(
            side,
            sums,
            contribution,
            me=me,
            gate=gate,
            trained_from=Subject("contribution", trained_from.encode(), data),
            records=records,
            on_census=lambda census: ledger.record_census(self._census_keys[0], census),
            noise=noise,
            class_names=class_names,
        )
        census = self.sums.census_subject
        # a census kept before keys were versioned is found under its version-2 key
        self._census_keys = (census.key(gate.consortium), census.v2_key(gate.consortium))
        if sums.census is not None and me in sums.census.silos:
            self._check_census_claim(sums.census)

    @property
    def purpose(self) -> str:
        return self.sums.purpose

    @property
    def done(self) -> bool:
        return self.sums.done

    def start(self) -> None:
        self._send(self.sums.start())

    def step(self, step: pb.SumStep) -> None:
        purpose, decoded = step_from_pb(step, layer=self.spec.privacy)
        decoded = self._transport.fetched(self.spec.round_id, purpose, decoded)
        self._send(self.sums.step(purpose, decoded))

    def _send(self, outgoing: list[tuple[str, object]]) -> None:
        self._unsent = list(outgoing)
        while self._unsent:
            purpose, message = self._unsent[0]
            self._transport.send(self.spec.round_id, purpose, message)
            del self._unsent[0]
            self._on_sent(purpose, message)

    def resume(self, transport: SiloTransport) -> None:
        """After a reconnect, with the new session's transport: send again what the lost connection may not
        have delivered (the same bytes: the aggregator takes a message it already holds as it is). A refusal
        because the sum has moved past that stage means it had arrived."""
        self._transport = transport
        unsent, self._unsent = self._unsent, []
        for purpose, message in unsent:
            try:
                transport.send(self.spec.round_id, purpose, message)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                what = type(message).__name__
                log.info("%s: its %s had arrived before the reconnect", self.spec.round_id, what)
                continue
            self._on_sent(purpose, message)

    def _check_census_claim(self, census: Census) -> None:
        """The RoundSpec's census must be the one this silo took part in and kept (it keeps one the moment it
        has computed it). A silo that signed the census but kept none (stopped before it could compute it)
        takes no census on the aggregator's word where the layer hides inputs: the aggregator could withhold
        the sum and name any counts. It leaves the round; the aggregator takes the census again over the same
        silos, which this silo allows. Under DP the census says nothing of this silo's records (it claims
        every class), and under plaintext the aggregator sees every input anyway: there a plausible census
        is taken."""
        kept = next(filter(None, map(self._ledger.census, self._census_keys)), None)
        signed_for = any(self._ledger.survivors(key) == list(census.silos) for key in self._census_keys)
        trusting = self.sums.noise is not None or (signed_for and not self.sums.side.hides_inputs)
        if kept is None and trusting:
            tail_guard.check_census(
                np.asarray(census.vector(), dtype=np.uint64),
                self.sums.census_input(),
                len(census.silos),
                self.sums.sums.record_floor,
            )
            self._ledger.record_census(self._census_keys[0], census)
        elif kept is None and signed_for:
            raise CensusError(
                "the RoundSpec names a census this silo signed for but never computed (it stopped before "
                "the result); it takes part again once the census is taken anew over the same silos"
            )
        elif kept != census:
            raise CensusError("the RoundSpec's census differs from the census this silo took part in")
