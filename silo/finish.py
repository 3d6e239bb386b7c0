"""A round's finish at this silo: its part in the round's sums, each step the aggregator sends, and the end.

The contribution leaves through the round's sums (`silo.participation`) over the layer the RoundSpec names,
with this silo's side of that layer; a protocol violation or a refused message ends this silo's part in the
round, and the agent goes on. Where the layer lets only silos read the sum (ckks), the silo also runs the
server step and reports the sealed next state (`silo.stepping`), then joins the evaluation sum of the state
it stepped to. The progress a restarted agent joins from is kept in the state directory
(`silo.connection.Progress`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import torch

from fedlt.aggregation.gate import ReleaseGate
from fedlt.aggregation.halves import Signer, SiloHalf
from fedlt.errors import FedltError
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.wire import drill_name, step_from_pb, upload_types
from silo.admission import AdmittedRound, PlanCache
from silo.connection import Progress, Standing
from silo.export import keep_stepped
from silo.key_service import KeyService
from silo.participation import Participation
from silo.releases import ReleaseLedger
from silo.stepping import report_evaluation, step_and_report
from silo.transport import SiloTransport
from silo.work import PendingContribution

log = logging.getLogger("silo")

# Dropout drills (operators rehearsing, and the tests): the agent freezes itself right after sending the named
# message (`privacy.wire.drill_name`) of a contribution sum, or of a census or evaluation sum as
# "census:<name>" or "evaluation:<name>", so a dropout can be placed at an exact stage.
DRILL = "FEDLT_DRILL_STOP_AFTER"


class Finish:
    """This silo's part in the sums of the round it contributes to (`taking_part`), from its first message to
    its end; where it steps the model, the round it steps from and then the evaluation sum it joined."""

    def __init__(
        self,
        state_dir: Path,
        *,
        gate: ReleaseGate,
        ledger: ReleaseLedger,
        keys: KeyService,
        plans: PlanCache,
        pending: PendingContribution,
        standing: Standing,
        progress: Progress,
        sign: Signer,
    ) -> None:
        self.state_dir, self.gate, self.ledger, self.keys, self.plans = state_dir, gate, ledger, keys, plans
        self.pending, self.standing, self.progress, self._sign = pending, standing, progress, sign
        self.taking_part: Participation | None = None
        # where this silo steps the model: the round it steps from, and the evaluation sum it joined last
        self._stepping: AdmittedRound | None = None
        self._evaluating: tuple[round_pb2.RoundSpec, SiloHalf] | None = None

    def take_part(self, transport: SiloTransport, admitted: AdmittedRound, payload: bytes) -> None:
        """Start this silo's part in the round's sums with the contribution `payload` (float64 bytes)."""
        spec, plan = admitted.spec, admitted.plan
        self.standing.activity = pb.SILO_ACTIVITY_UPLOADING  # until its sums end (`idle`)
        if admitted.side.steps_model:
            self._stepping = admitted
        contribution = torch.from_numpy(np.frombuffer(payload, dtype="<f8").copy())

        def start() -> None:
            self.taking_part = Participation(
                spec,
                admitted.sums,
                contribution,
                me=admitted.me,
                side=admitted.side,
                gate=self.gate,
                trained_from=admitted.state.content_digest(),
                data=admitted.prepared.data_digest,
                ledger=self.ledger,
                transport=transport,
                on_sent=lambda purpose, message: self._sent(spec, purpose, message),
                noise=self.plans.privacy(plan, spec.config_sha256),
                records=np.bincount(admitted.data.y, minlength=admitted.data.num_classes),
                class_names=plan.model.classes,
            )
            self.taking_part.start()

        self.stage(spec.round_id, start)

    def resumed(self, transport: SiloTransport, round_id: str) -> bool:
        """Whether this silo still takes part in `round_id`'s sums (a RoundSpec of it again, after a
        reconnect): then what the lost connection may not have delivered is sent again."""
        taking_part = self.taking_part
        if taking_part is None or taking_part.spec.round_id != round_id:
            return False
        log.info("%s: still taking part in its sums after a reconnect", round_id)
        self.stage(round_id, lambda: taking_part.resume(transport))
        return True

    def sum_step(self, transport: SiloTransport, step: pb.SumStep) -> None:
        if step.sum == pb.SECURE_SUM_EVALUATION:
            self.stage(step.round_id, lambda: self._evaluation_step(transport, step))
            return
        taking_part = self.taking_part
        if taking_part is None or taking_part.spec.round_id != step.round_id:
            log.warning("ignoring a step of %s, whose sums this silo is not in", step.round_id)
            return
        self.stage(step.round_id, lambda: taking_part.step(step))
        if taking_part.done:
            self.idle()
            if taking_part.sums.side.steps_model:
                self.stage(step.round_id, lambda: self._step_model(transport, taking_part))

    def aborted(self, round_id: str) -> None:
        """The aggregator aborted `round_id`: if this silo is in its sums, its part is over."""
        if self.taking_part is not None and self.taking_part.spec.round_id == round_id:
            self.idle()

    def stage(self, round_id: str, action: Callable[[], None]) -> None:
        """Run one stage; a protocol violation or a refused message ends this silo's part in the round."""
        try:
            action()
        except FedltError as exc:
            log.error("%s: leaving the round's sums: %s", round_id, exc)
            self.idle()
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise
            log.warning("%s: the aggregator refused a message: %s", round_id, exc.details())
            self.idle()

    def idle(self) -> None:
        """This silo's part in a round's sums is over (done, aborted or left): what status shows says so."""
        self.taking_part = None
        self.standing.activity = pb.SILO_ACTIVITY_IDLE

    def drop(self) -> None:
        """Leave whatever sums this silo is in without a word: another round begins, or the next session
        presents another certificate (the sums' messages are signed under this one: the round is retried)."""
        self.taking_part = None

    def _step_model(self, transport: SiloTransport, taking_part: Participation) -> None:
        """Only silos can read this round's sum: step the model here and report the sealed next state."""
        spec = taking_part.spec
        if self._stepping is None or self._stepping.spec.round_id != spec.round_id:
            log.error("%s: the starting state of the round is not at hand; not stepping", spec.round_id)
            return
        admitted = self._stepping
        evaluation, digest = step_and_report(
            transport,
            taking_part,
            side=admitted.side,
            sign=self._sign,
            secret=self.keys.secret(spec.privacy, admitted.sums.settings),
            state=admitted.state,
            method=admitted.method,
            held_out=admitted.held_out,
            held_out_digest=admitted.prepared.held_out_digest,
            gate=self.gate,
            keep=lambda header, sealed: keep_stepped(self.state_dir, spec, taking_part.me, header, sealed),
        )
        self._stepping, self._evaluating = None, (spec, evaluation)
        log.info("round %d: stepped the model to state %s, reported it sealed", spec.round, digest)

    def _evaluation_step(self, transport: SiloTransport, step: pb.SumStep) -> None:
        if self._evaluating is None or self._evaluating[0].round_id != step.round_id:
            log.warning("ignoring an evaluation sum of %s, which this silo did not join", step.round_id)
            return
        joined = self._evaluating
        spec, evaluation = joined
        self._evaluating = None
        purpose, announced = step_from_pb(step, layer=spec.privacy)
        summed = transport.fetched(spec.round_id, purpose, announced)
        sent = partial(self._sent, spec, "evaluation")
        if not report_evaluation(transport, spec.round, evaluation, summed, on_sent=sent):
            self._evaluating = joined  # signed: every silo's signature is next
            return
        log.info("round %d: reported the consortium's evaluation counts", spec.round)

    def _sent(self, spec: round_pb2.RoundSpec, purpose: str, message: object) -> None:
        """After each message: the contribution's upload ends the pending file; drills may stop here."""
        if purpose == "contribution" and type(message) in upload_types():
            self.pending.clear()
            self.progress.save(committed=spec.round - 1, submitted=spec.round_id)
            log.info("round %d: contribution accepted (%s)", spec.round, type(message).__name__)
        drill, name = os.environ.get(DRILL, ""), drill_name(message)
        if drill and name and drill == (name if purpose == "contribution" else f"{purpose}:{name}"):
            log.warning("drill: stopping after sending the %s message, as %s asks", drill, DRILL)
            os.kill(os.getpid(), signal.SIGSTOP)
