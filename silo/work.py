"""This silo's work in an admitted round: the disclosure its policy allows, and its contribution, trained on
its data from the checked state (or evaluated only, where the plan asks no training).

A finished contribution is written to disk before upload, keyed by the state it was trained from
(`PendingContribution`, in the study's own folder), so an agent restarted mid-upload, or handed the same state
under another label, sends the same bytes instead of training again; a disclosure is kept in the release
ledger the same way, by state and data. The disclosure's masks come from one secret per silo, across its
studies, and a disclosure is made with the mask and minimum it was first made with (kept in the ledger for
good): two studies of one silo disclosing from the same state and data disclose the same bytes, whatever
their plans ask, so that comparing them cannot tell a masked class from a held one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from fedlt.aggregation import evaluation_block
from fedlt.atomic import atomic_write, atomic_write_text, sync_directory
from fedlt.errors import ContributionError
from fedlt.methods import SiloContext
from fedlt.selection import DISCLOSURE, class_mean_disclosure, mask_stream
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.dp import BudgetExceeded
from silo.admission import AdmittedRound, PlanCache, RefusedRound
from silo.config import PolicySection
from silo.connection import Standing
from silo.releases import ReleaseLedger, RepeatedRelease
from silo.stepping import round_contribution
from silo.transport import SiloTransport

log = logging.getLogger("silo")


class PendingContribution:
    """pending.bin and pending.json in the state directory: the contribution trained last and what it was
    trained for, until its upload is taken."""

    def __init__(self, state_dir: Path) -> None:
        self._bin, self._meta = state_dir / "pending.bin", state_dir / "pending.json"

    def resent(self, admitted: AdmittedRound) -> bytes | None:
        """The contribution this silo trained from this state (and for this schema) in an earlier attempt or
        before a restart: resent, not retrained, whatever the attempt, round label, plan text or seed, so a
        retry costs no privacy budget again and releases nothing new."""
        spec = admitted.spec
        if self._meta.exists() and json.loads(self._meta.read_text()) == _pending_key(admitted):
            log.info("%s: resending the contribution trained for round %d", spec.round_id, spec.round)
            return self._bin.read_bytes()
        return None

    def keep(self, admitted: AdmittedRound, payload: bytes) -> None:
        atomic_write(self._bin, lambda fh: fh.write(payload))
        atomic_write_text(self._meta, json.dumps(_pending_key(admitted)))

    def clear(self) -> None:
        for path in (self._meta, self._bin):
            path.unlink(missing_ok=True)


class Work:
    """Discloses and trains for admitted rounds. `shared_dir` is the silo's state directory (across its
    studies), which keeps the mask secret; `refuse` tells the aggregator of a round this silo cannot work
    for (`silo.admission.Admission.refuse`)."""

    def __init__(
        self,
        shared_dir: Path,
        policy: PolicySection,
        *,
        ledger: ReleaseLedger,
        plans: PlanCache,
        pending: PendingContribution,
        standing: Standing,
        refuse: Callable[[SiloTransport, str, RefusedRound], None],
    ) -> None:
        self.shared_dir, self.policy, self.ledger, self.plans = shared_dir, policy, ledger, plans
        self.pending, self.standing, self._refuse = pending, standing, refuse

    def train(self, transport: SiloTransport, admitted: AdmittedRound) -> bytes | None:
        """Disclose if asked (the policy allowed it); train if a participant, and evaluate the starting state
        on the held-out slice where the plan asks. The contribution, as float64 bytes, kept as pending."""
        spec, plan = admitted.spec, admitted.plan
        if admitted.discloses:
            self._disclose(transport, admitted)
        if not admitted.trains:
            self.standing.activity = pb.SILO_ACTIVITY_IDLE
            return None
        self.standing.activity = pb.SILO_ACTIVITY_TRAINING
        started = time.perf_counter()
        private = self.plans.privacy(plan, spec.config_sha256)
        schema = admitted.sums.schema  # as admission checked it
        try:
            contribution = round_contribution(
                schema,
                admitted.method,
                admitted.state,
                admitted.data,
                admitted.held_out,
                SiloContext(spec.round, admitted.me, spec.seed, private),
            )
        except (BudgetExceeded, ContributionError) as exc:  # ContributionError: weights that train to inf
            self.standing.activity = pb.SILO_ACTIVITY_IDLE
            self._refuse(transport, spec.round_id, _not_training(spec, exc))
            return None
        trained = time.perf_counter() - started
        self.plans.announce_sigma(plan, spec.config_sha256)
        payload = np.ascontiguousarray(contribution.flat().numpy(), dtype="<f8").tobytes()
        self.pending.keep(admitted, payload)
        if evaluation_block.only_evaluates(schema):
            held_out = len(admitted.held_out) if admitted.held_out is not None else 0
            log.info("round %d: evaluated the last state on %d held-out samples", spec.round, held_out)
        else:
            log.info("round %d: trained on %d samples in %.2f s", spec.round, len(admitted.data), trained)
        return payload

    def _disclose(self, transport: SiloTransport, admitted: AdmittedRound) -> None:
        """MFSC: this silo's class means under the received model, random points for classes it lacks or holds
        too few samples of. One disclosure per round's state: a retried attempt sends the same bytes."""
        spec, method = admitted.spec, admitted.method
        values = self._disclosed(admitted)
        if values is None:
            return
        classes = method.model_spec.num_classes
        shape = [classes, len(values) // (8 * classes)]
        try:
            sha256 = transport.disclose(spec.round_id, name=DISCLOSURE, shape=shape, values=values)
        except grpc.RpcError as exc:  # the round goes on without it: picking falls back on older means
            reason = f"{exc.code().name}: {exc.details()}"
            log.warning("%s: the disclosure did not go through (%s)", spec.round_id, reason)
            return
        log.info(
            "round %d: disclosed masked class means (%s) as policy.disclosures allows; sha256 %s",
            spec.round,
            DISCLOSURE,
            sha256[:16],
        )

    def _disclosed(self, admitted: AdmittedRound) -> bytes | None:
        """The disclosure of this state and data, whatever round or study the aggregator labels it with: the
        values kept, or made again with the mask and minimum it was first made with (the plan's only for a
        first one). None where that is not the same bytes, or its minimum is below the policy's now."""
        state, plan = admitted.state, admitted.plan
        key = f"{state.content_digest()}/{admitted.prepared.data_digest}"
        made_with = self.ledger.disclosure_settings(key)
        if made_with is not None and made_with["min_samples"] < self.policy.disclosure_min_samples:
            log.warning(
                "%s: not disclosing: this state's class means were made with a minimum of %d samples, "
                "below policy.disclosure_min_samples = %d",
                admitted.spec.round_id,
                made_with["min_samples"],
                self.policy.disclosure_min_samples,
            )
            return None
        # one kept by an agent from before keys named the data is under the state's digest alone
        kept = self.ledger.disclosure(key) or self.ledger.disclosure(state.content_digest())
        if kept is not None:
            return kept
        made_with = made_with or {
            "mask": plan.selection.mask,
            "min_samples": max(plan.selection.min_samples, self.policy.disclosure_min_samples),
        }
        stream = mask_stream(self.mask_secret(), key)
        means = class_mean_disclosure(
            admitted.method,
            state,
            admitted.data,
            made_with["mask"],
            stream,
            min_samples=made_with["min_samples"],
        )
        values = np.ascontiguousarray(means.numpy(), dtype="<f8").tobytes()
        try:
            return self.ledger.record_disclosure(key, values, made_with)
        except RepeatedRelease as exc:
            log.warning("%s: not disclosing: %s", admitted.spec.round_id, exc)
            return None

    def mask_secret(self) -> bytes:
        """The key of this silo's MFSC masks: made once, kept in state_dir (owner-only), never sent; the
        first of its studies' agents to need it makes it, and every other reads that one."""
        path = self.shared_dir / "mask.secret"
        if not path.exists():
            _create_once(path, secrets.token_bytes(32))
        return path.read_bytes()


def _create_once(path: Path, content: bytes) -> None:
    """Write `path` (owner-only, synced) unless another process made it first: a link, unlike a rename, does
    not replace a file already there."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
    finally:
        Path(tmp).unlink(missing_ok=True)
    sync_directory(path.parent)


def _pending_key(admitted: AdmittedRound) -> dict[str, str]:
    """What a pending contribution was trained for: the state's content and the signed schema."""
    schema = hashlib.sha256(admitted.spec.schema.SerializeToString(deterministic=True)).hexdigest()
    return {"trained_from": admitted.state.content_digest(), "schema": schema}


def _not_training(spec: round_pb2.RoundSpec, exc: BudgetExceeded | ContributionError) -> RefusedRound:
    """The refusal of a round whose training cannot be done: the budget's figures, or the values training
    gave, stay in the silo's log."""
    message = f"{spec.round_id}: not training: {exc}"
    if isinstance(exc, BudgetExceeded):
        return RefusedRound(message, code=pb.REFUSAL_CODE_BUDGET)
    return RefusedRound(
        message, code=pb.REFUSAL_CODE_OTHER, told="local training under this plan gave no finite update"
    )
