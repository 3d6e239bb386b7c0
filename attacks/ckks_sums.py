"""Attack (g, ckks): a malicious aggregator chooses what each silo decrypts (issue 30, finding 3).

Threat model: the aggregator holds the public CKKS context, which adds a plaintext of its choosing to any
ciphertext, and it hands each silo "the sum". It hands the victim the true contribution sum and every other
silo the sum plus P, where P forces the stepped model to answer class k for every input; the evaluation sum
(each silo's per-class correct counts, masked with zero-sum masks) then holds, for class k, the victim's own
number of held-out records of class k, and one attempt per class gives the victim's label histogram.

Mounted with the real ckks halves (`privacy.ckks.halves`, in-process keys) and the real masks: once against
silos that decrypt whatever they are handed, with masks keyed by the round alone (fedlt before issue 30:
audited = False), then against the silos' consistency step, where a silo decrypts only a ciphertext every
silo of the sum signed (audited = True). The model is the least that shows it: a classifier's bias, which
the server step averages and which decides every prediction.
"""

from __future__ import annotations

import numpy as np
import tenseal as ts
import torch

from attacks.audit import Finding
from fedlt.aggregation import Field, Schema
from fedlt.aggregation.halves import BadMessage, SumSpec
from fedlt.errors import FedltError
from privacy.ckks.halves import CkksAggregatorHalf, EncryptedSum
from privacy.ckks.keys import Ciphertext, PublicContext, SecretContext
from privacy.ckks.layer import CkksSum
from privacy.stepping.masks import zero_sum_mask

SILOS, VICTIM, CLASSES = ("a", "b", "c"), "a", 6
SCHEMA = Schema((Field("bias", (CLASSES,), 10.0), Field("n", (), 100.0, frac_bits=0)))
FORCE = 1000.0  # added to one class's bias: every prediction is that class


def plus(public: PublicContext, blob: bytes, values: np.ndarray) -> bytes:
    """What the aggregator computes with its public context alone: a ciphertext plus a plaintext."""
    ciphertext, offset = Ciphertext.parse(ts.context_from(public.serialized), blob), 0
    for chunk in ciphertext.chunks:
        chunk.add_(values[offset : offset + chunk.size()].tolist())
        offset += chunk.size()
    return ciphertext.serialize()


def chosen_sums(seed: int = 0) -> list[Finding]:
    """The split against silos decrypting what they are handed, then against the consistency step."""
    rng = np.random.default_rng([seed, 3])
    labels = {u: rng.choice(CLASSES, size=40, p=rng.dirichlet(np.full(CLASSES, 0.5))) for u in SILOS}
    histogram = np.bincount(labels[VICTIM], minlength=CLASSES)
    target = int(np.argmax(histogram[1:]) + 1)  # a class the victim holds; every other silo is forced to 0
    sides, aggregator_side = CkksSum().in_process(SILOS)
    spec = SumSpec("r1.a1", "contribution", SILOS, SCHEMA, b"the RoundSpec's hash")
    halves = {u: sides[u].half(spec, u, may_release=lambda _: None) for u in SILOS}
    aggregator = aggregator_side.half(spec)
    for u, half in halves.items():
        (upload,) = half.start(torch.from_numpy(np.append(rng.uniform(-0.1, 0.1, CLASSES), 10.0)))
        aggregator.receive(u, upload)
    aggregator.close()
    handed = _split(aggregator, aggregator_side.keys, target)
    secret = sides[VICTIM].secret_for(None)
    read = _evaluation_as_it_was(secret, handed, labels)
    recovered = read == histogram[target]
    naive = Finding(
        attack="protocol: ckks chosen sum",
        mode="silos decrypting what they are handed",
        party="aggregator",
        target=f"silo {VICTIM}'s held-out records of class {target} (a class an attempt: its labels)",
        metrics={
            "victims_count": float(histogram[target]),
            "read": float(read),
            "recovered": float(recovered),
        },
        leaked=bool(recovered),
        audited=False,
        note="the victim stepped from the true sum, the others from the sum plus P: the evaluation sum's "
        f"correct count of class {target} is the victim's own",
    )
    refusals, decrypted = _consistency(halves, aggregator, handed)
    return [
        naive,
        Finding(
            attack="protocol: ckks chosen sum",
            mode="silo consistency step",
            party="aggregator",
            target=naive.target,
            metrics={"silos_decrypting": float(decrypted), "silos_refusing": float(len(refusals))},
            leaked=decrypted > 0,
            audited=True,
            note=f"refused: {next(iter(refusals.values()), 'no silo refused')}",
        ),
    ]


def _split(aggregator: CkksAggregatorHalf, public: PublicContext, target: int) -> dict[str, bytes]:
    """The victim's model forced to `target`, every other one's to class 0."""
    handed = {}
    for u in SILOS:
        forced = np.zeros(SCHEMA.size)
        forced[target if u == VICTIM else 0] = FORCE
        handed[u] = plus(public, aggregator.summed, forced)
    return handed


def _evaluation_as_it_was(
    secret: SecretContext, handed: dict[str, bytes], labels: dict[str, np.ndarray]
) -> int:
    """What the aggregator read before the fix: each silo decrypted what it was handed, stepped its bias,
    counted its held-out predictions, and masked them with masks that cancel over the round's silos whatever
    models they stepped to; the summed correct count of the victim's forced class."""
    masked = []
    for u in SILOS:
        bias = secret.decrypt(handed[u], SCHEMA.size)[:CLASSES]
        predicted = np.full(len(labels[u]), int(np.argmax(bias)))
        correct = np.bincount(labels[u][labels[u] == predicted], minlength=CLASSES)
        counts = np.concatenate([correct, np.bincount(labels[u], minlength=CLASSES)]).astype(np.float64)
        mask = zero_sum_mask(secret, "round-1/evaluation", u, SILOS, len(counts))
        masked.append(secret.encrypt(counts + mask, scale_bits=30))
    summed = np.rint(secret.decrypt(secret.public.add(masked), 2 * CLASSES)).astype(np.int64)
    victim_bias = secret.decrypt(handed[VICTIM], SCHEMA.size)[:CLASSES]
    return int(summed[int(np.argmax(victim_bias))])


def _consistency(halves: dict, aggregator: CkksAggregatorHalf, handed: dict[str, bytes]) -> tuple[dict, int]:
    """Each silo signs the ciphertext it was handed; the aggregator relays every signature; a silo decrypts
    only if all of them sign what it signed. Returns why each silo refused, and how many decrypted."""
    refusals: dict[str, str] = {}
    for u, half in halves.items():
        (signature,) = half.step(EncryptedSum(handed[u], SILOS))
        aggregator.receive(u, signature)
    steps = aggregator.close()
    for u, half in halves.items():
        try:
            half.step(steps[u])
        except (BadMessage, FedltError) as exc:
            refusals[u] = str(exc)
    return refusals, sum(half.result is not None for half in halves.values())
