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
            on_census=self._keep_census,
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

    def _keep_census(self, census: Census, checked: bool) -> None:
        """Keep a census this round took, apart by whether this silo checked it (`SiloRound.on_census`)."""
        if checked:
            self._ledger.record_census(self._census_keys[0], census)
        else:
            self._ledger.record_unchecked_census(self._census_keys[0], census)

    def _kept(self, find: Callable[[str], Census | None]) -> Census | None:
        """The census `find` has under this silo's census keys (a census kept before keys were versioned is
        under its version-2 key)."""
        return next(filter(None, map(find, self._census_keys)), None)

    def _check_census_claim(self, census: Census) -> None:
        """The RoundSpec's census must be the one this silo took part in and kept (it keeps one the moment it
        has computed it). Under DP the census says nothing of this silo's records (it claims every class),
        and under plaintext the aggregator sees every input anyway: there a plausible census is taken (and
        kept as unchecked). A round that hides inputs without DP guards only with a census this silo checked
        (`_check_own`), in whatever study it was taken."""
        signed_for = any(self._ledger.survivors(key) == list(census.silos) for key in self._census_keys)
        if self.sums.noise is None and (self.sums.side.hides_inputs or not signed_for):
            self._check_own(census, signed_for=signed_for)
            return
        unchecked = self._kept(self._ledger.unchecked_census)
        if census in (unchecked, self._kept(self._ledger.census)):
            return
        if unchecked is not None:
            raise CensusError("the RoundSpec's census differs from the census this silo took part in")
        tail_guard.check_census(
            np.asarray(census.vector(), dtype=np.uint64),
            self.sums.census_input(),
            len(census.silos),
            self.sums.sums.record_floor,
        )
        self._ledger.record_unchecked_census(self._census_keys[0], census)

    def _check_own(self, census: Census, *, signed_for: bool) -> None:
        """Without DP, where the layer hides inputs (or under plaintext this silo never signed for it), a
        census is the aggregator's word unless this silo computed it: it could withhold the sum and name any
        counts, or name one a study under DP or plaintext kept (under DP: every class everywhere). Refused,
        the silo leaves the round, and the aggregator takes the census again over the same silos, which this
        silo allows."""
        checked = self._kept(self._ledger.census)
        if checked == census:
            return
        if checked is None and self._kept(self._ledger.unchecked_census) == census:
            raise CensusError(
                "the RoundSpec names a census this silo kept without checking it (under DP every silo "
                "claims every class; under plaintext it is the aggregator's reading; or kept before this "
                "silo marked the censuses it checked): a round that hides inputs without DP guards only with "
                "a census this silo computed itself; it takes part again once the census is taken anew over "
                "the same silos"
            )
        if checked is None and signed_for:
            raise CensusError(
                "the RoundSpec names a census this silo signed for but never computed (it stopped before "
                "the result); it takes part again once the census is taken anew over the same silos"
            )
        raise CensusError("the RoundSpec's census differs from the census this silo took part in")
