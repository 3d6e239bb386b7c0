"""Attack (g, blind): a malicious aggregator hands silos different totals (issue 30's finding 3, under blind).

Threat model: under blind the aggregator unmasks secagg's masks and hands every silo of the sum the total,
still under the silos' output masks; silos sign nothing of the total they are handed, and a ring total takes
any vector added to it (the output masks stay, and come off as before). It hands the victim the total plus
a P that forces the stepped model to answer class k for every input, and every other silo the total plus one
forcing class 0; if the evaluation sum of the silos' counts added up, its correct count of class k would be
the victim's own number of held-out records of class k, and one attempt per class its label histogram.

Mounted with the real blind halves in one process (`BlindSum.in_process`: the contribution sum through the
round driver, then each silo's evaluation half), the silos' own check of what they report
(`silo.stepping.report_evaluation`), and the binding `silo.stepping.step_and_report` gives the evaluation
sum: once bound to the round alone (the contrast, audited = False), then, as silos bind it, to the state
each silo stepped to too (audited = True): the victim's masks and the others' are drawn for different sums,
cancel in neither, and every silo reads masks, not counts, which it refuses to report. The zero-sum masks
`step_and_report` adds on top are bound the same way and left out here. The model is the least that shows
it, as in `attacks.ckks_sums`: a classifier's bias, which decides every prediction.
"""

from __future__ import annotations

import numpy as np
import torch

from attacks.audit import Finding
from fedlt.aggregation import Field, Schema
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate, Subject
from fedlt.aggregation.halves import SiloHalf, SiloSide, SumAborted, SumSpec, evaluation_schema
from fedlt.aggregation.round_sums import AggregatorRound, RoundSums, SiloRound
from fedlt.aggregation.sums import run_round
from privacy.blind.halves import BlindTotal
from privacy.blind.layer import BlindSum
from privacy.crypto import transcript
from privacy.secagg.halves import codec_of
from silo.stepping import report_evaluation
from silo.transport import SiloTransport

SILOS, VICTIM, CLASSES = ("a", "b", "c"), "a", 6
SCHEMA = Schema((Field("bias", (CLASSES,), 10.0), Field("n", (), 100.0, frac_bits=0)))
FORCE = 1000.0  # added to one class's bias: every prediction is that class
ROUND_ID = "r1.a1"


class _Reports:
    """The aggregator's end of `ReportEvaluation`: what a silo reported."""

    def __init__(self) -> None:
        self.correct: list[int] | None = None

    def ReportEvaluation(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        self.correct = list(request.correct)


def chosen_totals(seed: int = 0) -> list[Finding]:
    """The split against evaluation masks bound to the round alone, then against masks bound to the state
    each silo stepped to."""
    rng = np.random.default_rng([seed, 4])
    labels = {u: rng.choice(CLASSES, size=40, p=rng.dirichlet(np.full(CLASSES, 0.5))) for u in SILOS}
    histogram = np.bincount(labels[VICTIM], minlength=CLASSES)
    target = int(np.argmax(histogram[1:]) + 1)  # a class the victim holds; every other silo is forced to 0
    inputs = {u: torch.from_numpy(np.append(rng.uniform(-0.1, 0.1, CLASSES), 10.0)) for u in SILOS}
    findings = []
    for bound_to_state in (False, True):
        read, refusals = _split(inputs, labels, target, bound_to_state=bound_to_state)
        recovered = read is not None and read == histogram[target]
        findings.append(
            Finding(
                attack="protocol: blind chosen total",
                mode="evaluation masks bound to the stepped state"
                if bound_to_state
                else "evaluation masks bound to the round alone",
                party="aggregator",
                target=f"silo {VICTIM}'s held-out records of class {target} (a class an attempt: its labels)",
                metrics={  # "read" only where a silo reported counts
                    "victims_count": float(histogram[target]),
                    **({} if read is None else {"read": float(read)}),
                    "silos_reporting": float(len(SILOS) - len(refusals)),
                    "recovered": float(recovered),
                },
                leaked=bool(recovered),
                audited=bound_to_state,
                note=f"refused: {next(iter(refusals.values()))}"
                if refusals
                else f"the victim's total forced its model to class {target}, the others' to class 0: the "
                f"evaluation sum's correct count of class {target} is the victim's own",
            )
        )
    return findings


def _split(
    inputs: dict[str, torch.Tensor], labels: dict[str, np.ndarray], target: int, *, bound_to_state: bool
) -> tuple[int | None, dict[str, str]]:
    """One round: the contribution sum with the victim handed the true total and the others the total plus
    P, each silo's evaluation counts of the model it stepped to, and their sum. The correct count of
    `target` the silos report (None: none reported) and why each silo that refused did."""
    sides, aggregator_side = BlindSum().in_process(SILOS)
    sums = RoundSums(ROUND_ID, SILOS, SCHEMA, k_min=0, census=None)
    rounds = {
        u: SiloRound(
            sides[u],
            sums,
            inputs[u],
            me=u,
            gate=ReleaseGate(
                consortium="audit", floors=Floors(), members=lambda: SILOS, ledger=MemoryLedger()
            ),
            trained_from=Subject("contribution", b"the state of round 1"),
        )
        for u in SILOS
    }
    aggregator = AggregatorRound(aggregator_side, sums)
    run_round(aggregator, rounds, relay=lambda u, step: _forced(aggregator, u, step, target))
    halves = {u: _evaluation(sides[u], u, rounds[u].result, labels[u], bound_to_state) for u in SILOS}
    evaluation = aggregator_side.half(next(iter(halves.values()))[0].spec)
    for u, (_, upload) in halves.items():
        evaluation.receive(u, upload)
    totals = evaluation.close()
    refusals, reported = {}, _Reports()
    for u, (half, _) in halves.items():
        try:
            report_evaluation(SiloTransport(reported, timeout=5.0), 1, half, totals[u])
        except SumAborted as exc:
            refusals[u] = str(exc)
    return (None if reported.correct is None else reported.correct[target]), refusals


def _forced(aggregator: AggregatorRound, silo: str, step: object, target: int) -> object:
    """The total handed to `silo`, plus P: forcing the victim's model to `target` and every other one's to
    class 0, so that the victim's held-out records of `target` are the only correct ones of that class."""
    if not isinstance(step, BlindTotal):
        return step
    codec = codec_of(aggregator.half.spec)
    forced = torch.zeros(SCHEMA.size, dtype=torch.float64)
    forced[target if silo == VICTIM else 0] = FORCE
    total = np.frombuffer(step.total, dtype=np.uint8).copy()
    codec.ring.add(total, codec.encode(forced))
    return BlindTotal(total.tobytes())


def _evaluation(
    side: SiloSide, me: str, summed: torch.Tensor, labels: np.ndarray, bound_to_state: bool
) -> tuple[SiloHalf, object]:
    """`me`'s half of the evaluation sum of the model it stepped to from `summed` (its bias: every input is
    predicted its argmax), bound as `step_and_report` binds it, or to the round alone; and its upload."""
    bias = summed[:CLASSES]
    predicted = int(torch.argmax(bias))
    correct = np.bincount(labels[labels == predicted], minlength=CLASSES)
    counts = np.concatenate([correct, np.bincount(labels, minlength=CLASSES)]).astype(np.float64)
    digest = transcript("stepped", bias.numpy().tobytes()).hex()
    binding = transcript("audit", "1", ROUND_ID, "state-of-round-1", *([digest] if bound_to_state else []))
    spec = SumSpec(ROUND_ID, "evaluation", SILOS, evaluation_schema(CLASSES), binding)
    half = side.half(spec, me, may_release=lambda _: None)
    (upload,) = half.start(torch.from_numpy(counts))
    return half, upload
