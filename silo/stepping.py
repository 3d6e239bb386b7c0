"""Where only silos can read a round's sum (a layer that `silos_step`, e.g. ckks): this silo opens the sealed
state, steps the model itself, seals the next state for the aggregator to keep, signs it, and adds its
evaluation counts to one more sum. The sealing key is the consortium's shared key, from the key service
(`silo.key_service`); any layer's side and key serve, as this module names none.

The next state must be the same at every silo to the bit: every silo reads the one sum all of them signed
(under ckks, decrypts the one ciphertext, `privacy.ckks.halves`), already on each field's grid, and the server
step runs on one torch thread here, so every silo on the same software computes the same numbers. Each one
signs the digest it computed, the round and the silos the sum counted (`privacy.stepping.attestation`); the
aggregator commits a state only if every counted silo reported it, and the next round's silos step from it
only if every one of them signed it (`opened_state`), so a state one silo computed alone, or a seal any key
holder could make, is not enough. The state of round 1 is the method's seeded initial state, public anyway,
so it comes unsealed and unsigned, and is checked against the seed.

The evaluation counts a silo adds are masked (`privacy.stepping.masks`) with masks bound to the state this
silo stepped to and to the exact silo set: they cancel only in the sum over every silo of the set, and only if
all of them stepped to the same state; any other sum (under ckks, any other ciphertext) reads as no counts,
which the silo does not report.

Where the aggregator steps the model (secagg, plaintext) the same counts, of the state a round starts from,
ride in the round's contribution instead when the plan asks for held-out evaluation (`round_contribution`,
`fedlt.aggregation.evaluation_block`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from fedlt.aggregation import Contribution, Schema, SumLayer, evaluation_block
from fedlt.aggregation.gate import ReleaseGate, Subject
from fedlt.aggregation.halves import (
    EVALUATION_BOUND,
    Peers,
    Signer,
    SiloHalf,
    SiloSide,
    SumAborted,
    SumSpec,
    evaluation_schema,
)
from fedlt.aggregation.registry import SharedSecret
from fedlt.data.arrays import LabeledData
from fedlt.device import resolve_device
from fedlt.methods import GlobalState, Method, ServerContext, SiloContext
from fedlt.methods.base import reported_counts
from fedlt.methods.state import pack_state, unpack_state
from fedlt.metrics import predict
from fedlt.plan import RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from privacy.crypto import transcript
from privacy.stepping.attestation import Attested, attest, check_attested
from privacy.stepping.masks import zero_sum_mask
from privacy.stepping.sealed_state import SealedStateError, open_state, seal_state
from privacy.wire import payload_of
from silo.participation import Participation
from silo.transport import SiloTransport


class StateRefused(SumAborted):
    """A state this silo will not start from: not the seeded initial one, or not sealed with the key."""


@contextmanager
def one_thread() -> Iterator[None]:
    """Float sums in parallel kernels depend on the thread count; one thread makes every silo agree."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def opened_state(
    data: bytes,
    spec: round_pb2.RoundSpec,
    secret: SharedSecret,
    method: Method,
    *,
    older: Sequence[SharedSecret] = (),
    peers: Peers,
    min_counted: int,
) -> GlobalState:
    """The starting state from what FetchState streamed: the seeded one in round 1; after it, a state every
    silo its sum counted signed (at least `min_counted` of them, each a member `peers` accepts), opened from
    its seal. A state sealed before a key rotation opens with the old key (`older`: the other keys this silo
    holds)."""
    if spec.round == 1:
        state = unpack_state(data, 0)
        if state.digest() != method.init_state(seed=spec.seed).digest():
            raise StateRefused("the first state is not the method's initial state for the signed seed")
        return state
    bound = {"consortium": spec.consortium_id, "round_number": spec.round - 1, "digest": spec.state_digest}
    check_attested(Attested.from_pb(spec.attestations), **bound, peers=peers, min_counted=min_counted)
    refusals = []
    for key in (secret, *(k for k in older if k.context_id != secret.context_id)):  # older: after a rotation
        try:
            return unpack_state(open_state(key, **bound, sealed=data), spec.round - 1)
        except SealedStateError as exc:
            refusals.append(exc)
    raise refusals[0]


def evaluation_counts(method: Method, state: GlobalState, held_out: LabeledData | None) -> torch.Tensor:
    """Correct and total per class on the held-out slice (zeros without one), as one vector; the model runs
    on this silo's device (`[compute] device`)."""
    classes = method.model_spec.num_classes
    if held_out is None or not len(held_out):
        return torch.zeros(2 * classes, dtype=torch.float64)
    device = resolve_device(method.train.device, setting="compute.device")
    predicted = predict(method.eval_model(state), held_out.x, device=device)
    correct = np.bincount(held_out.y[held_out.y == predicted], minlength=classes)
    total = np.bincount(held_out.y, minlength=classes)
    return torch.from_numpy(np.concatenate([correct, total]).astype(np.float64))


def expected_schema(plan: RoundPlan, method: Method, state: GlobalState, *, steps_model: bool) -> Schema:
    """The schema this silo expects of a round from `state`, whatever the RoundSpec signs: the method's, with
    the evaluation block where the plan asks for held-out evaluation; where silos step the model they sum
    their counts apart, so a RoundSpec asking for the block there is refused."""
    schema = method.schema(state)
    if steps_model:
        return schema
    return plan.round_schema(schema, starting_round=state.round, remaining=method.remaining_rounds(state))


def round_contribution(
    schema: Schema,
    method: Method,
    state: GlobalState,
    data: LabeledData,
    held_out: LabeledData | None,
    ctx: SiloContext,
) -> Contribution:
    """This silo's contribution to a round of `schema` (as `expected_schema` checked it): the method's local
    round and, where the schema carries the evaluation block, the starting state's counts on the held-out
    slice and, in the first round, the record counts as this silo may report them (under DP noised once per
    run, in its budget plan already); the evaluation-only round trains nothing."""
    names = {f.name for f in schema.fields}
    if not names & evaluation_block.BLOCK:
        return method.local_round(state, data, ctx)
    counts = evaluation_counts(method, state, held_out)  # before training moves the working model
    trained = None if evaluation_block.only_evaluates(schema) else method.local_round(state, data, ctx)
    records = reported_counts(data.class_counts(), ctx) if evaluation_block.RECORDS in names else None
    return evaluation_block.contribution(schema, trained, counts, records)


def step_and_report(
    transport: SiloTransport,
    taking_part: Participation,
    *,
    side: SiloSide,
    sign: Signer,
    secret: SharedSecret,
    state: GlobalState,
    method: Method,
    held_out: LabeledData | None,
    gate: ReleaseGate,
    keep: Callable[[pb.StateReportHeader, bytes], None] | None = None,
    held_out_digest: str = "",
) -> tuple[SiloHalf, str]:
    """Run the server step on the sum this silo read, report the sealed next state signed with the silo's
    certificate key (`sign`); returns the half of the evaluation sum the aggregator will send back (for
    `report_evaluation`) and the new state's digest. The evaluation counts pass the silo's release gate like
    any other release, keyed by the state they evaluate and the held-out data they count (`held_out_digest`,
    `gate.data_digest` of it). `keep` is handed the report (its header and the sealed state) once the
    aggregator accepted it (`silo.export.keep_stepped`)."""
    spec, sums = taking_part.spec, taking_part.sums
    survivors = tuple(sorted(sums.half.counted))
    readers = tuple(sorted(sums.half.readers))  # who read the sum and step with this silo (blind: U4)
    total = SumLayer.seal(sums.sums.schema, sums.result, len(survivors))
    with one_thread():
        following = method.server_step(state, total, ServerContext(spec.round, spec.seed))
    digest = following.digest()
    sealed = seal_state(
        secret,
        consortium=spec.consortium_id,
        round_number=spec.round,
        digest=digest,
        packed=pack_state(following),
    )
    attested = {"consortium": spec.consortium_id, "round_number": spec.round, "digest": digest}
    signature = attest(sign, **attested, counted=survivors, readers=readers)
    # the masks and the sum's signatures are bound to the state this silo stepped to, not only to labels
    # the aggregator chooses: they cancel, and the survivors' signatures agree, only among silos that
    # read the same sum and computed the same state
    binding = transcript(spec.consortium_id, str(spec.round), spec.round_id, spec.state_digest, digest)
    evaluated = SumSpec(
        spec.round_id,
        "evaluation",
        readers,
        evaluation_schema(method.model_spec.num_classes),
        binding,
        settings=sums.sums.settings,
    )
    gate.admit(evaluated, side)
    subject = Subject("evaluation", following.content_digest().encode(), held_out_digest)
    evaluation = side.half(
        evaluated,
        taking_part.me,
        may_release=lambda counted: gate.release(evaluated, side, counted, subject),
    )
    counts = evaluation_counts(method, following, held_out)
    mask = zero_sum_mask(secret, f"{binding.hex()}/evaluation", taking_part.me, readers, len(counts))
    (upload,) = evaluation.start(counts + torch.from_numpy(mask))
    kind, payload = payload_of(upload)
    header = pb.StateReportHeader(
        round_id=spec.round_id,
        state_digest=digest,
        total_bytes=len(sealed),
        sha256=hashlib.sha256(sealed).hexdigest(),
        next_schema=schema_to_pb(method.schema(following)),
        remaining_rounds=method.remaining_rounds(following),
        next_trains=method.trains(following),
        evaluation=payload,
        evaluation_kind=kind,
        state_signature=signature,
        round=spec.round,
        counted=survivors,
    )
    transport.report_state(header, sealed)
    if keep is not None:
        keep(header, sealed)
    return evaluation, digest


def report_evaluation(
    transport: SiloTransport,
    round_number: int,
    evaluation: SiloHalf,
    step: object,
    on_sent: Callable[[object], None] | None = None,
) -> bool:
    """One step of the evaluation sum, as the layer's half takes it (ckks: handed the encrypted sum, sign it
    and send the signature; handed every silo's signature, decrypt, the half's release check first); once
    read, report the per-class totals, only if they are counts: anything but the sum over every silo that
    masked its counts, all having stepped to the same state, still carries masks. True once reported.
    `on_sent` is handed each message once sent (drills stop there)."""
    outgoing = evaluation.step(step)
    if not evaluation.done:
        for message in outgoing:
            transport.send(evaluation.spec.round_id, "evaluation", message)
            if on_sent is not None:
                on_sent(message)
        return False
    counts = np.rint(evaluation.result.numpy()).astype(np.int64)
    classes = len(counts) // 2
    correct, total = counts[:classes], counts[classes:]
    if (correct < 0).any() or (correct > total).any() or (total > EVALUATION_BOUND).any():
        raise SumAborted("the evaluation sum decrypts to no counts (masks left over): not the sum it names")
    transport.report_evaluation(round_number, correct=correct.tolist(), total=total.tolist())
    return True
