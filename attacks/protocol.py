"""Attack (g): a malicious aggregator against the silos' own protocol code, so the report shows them refusing.

Threat model: the aggregator is malicious, not merely curious. It picks who takes part in every round, what
each silo is shown at every stage of a secure sum, how many attempts a round gets and which session parameters
(threshold, graph) a RoundSpec proposes, and it may collude with a few silos. It cannot forge a silo's
signature. The design rule under attack is "the silo never trusts the aggregator": whatever could weaken a
silo's privacy is checked at the silo. Every attack here runs the real code (`privacy.secagg`, the round
driver and tail guard of `fedlt.aggregation`, `silo.participation` and `silo.releases`), once against a naive
design for contrast (audited = False) and once against what silos run (audited = True):

- `presence_intersection`: which classes a silo holds does not change between rounds, so per-class presence
  sums over changing participant sets form a linear system in every silo's presence bits. The aggregator
  keeps every 0/1 holding consistent with what it was released; a bit is recovered when all of them agree.
  Against a census per round it recovers every bit; against the `secagg` layer (one census per silo set,
  per-class rows only in sums over that census set) it learns no bit the one census's counts do not already
  imply (a class that none or all of the census set hold).
- `two_attempts`: a round's contribution is the same in every attempt, so summing attempt 1 over {a, b, c},
  aborting, and summing attempt 2 over {a, b, c, v} gives v's contribution as the difference. Mounted with
  each silo's `Participation` and the real round driver, against silos that forget what they signed (their
  ledger file deleted between attempts), and with the second attempt relabelled (a comment appended to the
  plan, a new seed, another round number: the same state, a new label) against silos whose ledger is keyed
  by those labels; then each against the silos' release gate, whose ledger is keyed by the state trained
  from: one survivor set.
  Mounted under `secagg`, where the aggregator reads each sum, and under `blind`, where only silos read them:
  there the aggregator alone holds two totals under fresh output masks, whose difference is noise, so the
  attacker is the aggregator with one silo of the first attempt, which holds the output key and reads both
  sums; the gate refuses it alike. The census relabelling below is mounted under both layers the same way.
- `chosen_sums` (`attacks.ckks_sums`): under ckks, the aggregator hands silos different ciphertext "sums" and
  reads one silo's held-out counts from the evaluation sum; refused by the ckks consistency step.
  `chosen_totals` (`attacks.blind_sums`): the same under blind, where silos sign no total they are handed;
  refused because the evaluation masks are bound to the state each silo stepped to.
- `split_views`: sessions that let the aggregator split silos into views or weaken them. The split-view attack
  (some honest silos told the victim survived, the others that it dropped out, colluders signing both views)
  is mounted end to end on a bare-majority threshold, where one colluder suffices, and on the default
  threshold, where it needs 2t − n colluders; the silo policy's refusal of weak sessions (bare majority,
  exactly two thirds, two silos, sparse SecAgg+ graphs) and the clients' refusal of key lists that differ
  between silos or carry substituted keys are shown as findings.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric import ec

from attacks.audit import Finding
from attacks.blind_sums import chosen_totals
from attacks.census_bits import pinned
from attacks.ckks_sums import chosen_sums
from fedlt.aggregation import Field, Schema, make_layer, record
from fedlt.aggregation.gate import Floors, ReleaseGate, Subject
from fedlt.aggregation.halves import PartyKeys, Released, SiloSide, SumAborted, SumSpec
from fedlt.aggregation.round_sums import AggregatorRound
from fedlt.aggregation.tail_guard import Census
from fedlt.errors import FedltError
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from fedlt.wire.codec import entries_of
from privacy import crypto, roundspec
from privacy.blind.halves import BlindTotal
from privacy.peers import KeyPeers
from privacy.pki.signing import sign
from privacy.ring import Ring, apply_masks
from privacy.secagg import shamir
from privacy.secagg.halves import codec_of
from privacy.secagg.layer import SecAggSum
from privacy.secagg.local import run_session
from privacy.secagg.protocol import (
    CONSISTENCY_CONTEXT,
    ENVELOPE_PURPOSE,
    KEYS_CONTEXT,
    AdvertisedKeys,
    Envelope,
    Inbox,
    SecAggClient,
    SecAggError,
    SessionSpec,
    pair_seed,
)
from privacy.secagg.settings import PolicyRefusal, SessionPolicy
from silo.participation import Participation
from silo.releases import LEDGER, ReleaseLedger

AGGREGATOR = "aggregator"


def protocol_findings(seed: int = 0) -> list[Finding]:
    """Every protocol attack's findings, naive contrast and real silo code, in the order of the docstring."""
    return [
        *presence_intersection(seed),
        *two_attempts(seed),
        *two_attempts(seed, layer="blind"),
        *census_relabels(seed),
        *census_relabels(seed, layer="blind"),
        *split_views(seed),
        *chosen_sums(seed),
        *chosen_totals(seed),
    ]


# --- (1) presence intersection ------------------------------------------------------------------------------

CLASSES, SILOS, PER_ROUND, ROUNDS = 6, 10, 5, 15
PRESENCE_SCHEMA = Schema(
    (
        Field("delta", (4,), 10.0, frac_bits=16),
        Field("present", (CLASSES,), 1.0, frac_bits=0, per_class=True),
    )
)
NAMES = [f"silo-{k}" for k in range(SILOS)]  # single digits: sorted order is index order

Equations = list[list[tuple[tuple[int, ...], int]]]  # per class: (silos summed, their presence sum)


def presence_intersection(seed: int = 0) -> list[Finding]:
    """Solves per-class presence sums over 10 silos, 5 a round, for each silo's holdings: against a census
    every round, then against what the real `secagg` layer (census once, tail guard) releases."""
    rng = np.random.default_rng(seed)
    truth = (rng.random((SILOS, CLASSES)) < np.linspace(1.0, 0.2, CLASSES)).astype(np.int64)
    rounds = _schedule(rng)
    census_only: Equations = [[(rounds[0], int(n))] for n in truth[list(rounds[0])].sum(axis=0)]
    baseline = _recovered(census_only, truth)

    naive: Equations = [[(p, int(truth[list(p), c].sum())) for p in rounds] for c in range(CLASSES)]
    real, rows_released = _secagg_view(truth, rounds, seed)
    findings = []
    for mode, equations, released, audited in (
        ("census every round", naive, len(rounds), False),
        ("secagg + tail guard", real, rows_released, True),
    ):
        recovered = _recovered(equations, truth)
        metrics = {
            "bits_recovered": recovered,
            "bits_from_census_counts": baseline,
            "bits_beyond_census": recovered - baseline,
            "system_rank": float(_rank([p for eqs in equations for p, _ in eqs])),
            "rounds": float(len(rounds)),
            "rounds_with_class_rows": float(released),
        }
        note = (
            "the only bits known are those one census's counts imply (a class none or all of its silos hold)"
            if recovered <= baseline
            else ""
        )
        findings.append(
            Finding(
                attack="protocol: presence intersection",
                mode=mode,
                party=AGGREGATOR,
                target=f"which of {SILOS} silos holds which of {CLASSES} classes, over changing silo sets",
                metrics=metrics,
                leaked=recovered > baseline,
                audited=audited,
                note=note,
            )
        )
    return findings


def _schedule(rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Partial participation, drawn until the sets determine every silo: the naive attack's usual case."""
    rounds: list[tuple[int, ...]] = []
    while len(rounds) < ROUNDS or (_rank(rounds) < SILOS and len(rounds) < 10 * ROUNDS):
        rounds.append(tuple(sorted(rng.choice(SILOS, PER_ROUND, replace=False).tolist())))
    return rounds


def _rank(sets: Sequence[tuple[int, ...]]) -> int:
    """Rank of the silo-incidence matrix of `sets`: how many silos' values linear algebra alone can pin."""
    if not sets:
        return 0
    a = np.zeros((len(sets), SILOS))
    for i, members in enumerate(sets):
        a[i, list(members)] = 1
    return int(np.linalg.matrix_rank(a))


def _secagg_view(truth: np.ndarray, rounds: list[tuple[int, ...]], seed: int) -> tuple[Equations, int]:
    """What the aggregator learns from the real layer: the census, and each round's per-class rows that
    the tail guard did not zero (it knows which it zeroed: `layer.zeroed` is its own record)."""
    layer = SecAggSum()
    equations: Equations = [[] for _ in range(CLASSES)]
    rows_released = 0
    for r, picked in enumerate(rounds, start=1):
        contributions = []
        for k in picked:
            delta = np.random.default_rng([seed, r, k]).normal(size=4)
            contributions.append(
                PRESENCE_SCHEMA.contribution(
                    delta=torch.from_numpy(delta), present=torch.from_numpy(truth[k].astype(np.float64))
                )
            )
        sums = layer.aggregate(PRESENCE_SCHEMA, contributions, silos=[NAMES[k] for k in picked])
        present = np.rint(sums["present"].numpy()).astype(np.int64)
        open_classes = [c for c in range(CLASSES) if c not in layer.zeroed]
        rows_released += bool(open_classes)
        for c in open_classes:
            equations[c].append((picked, int(present[c])))
    for census in layer.censuses.values():
        members = tuple(NAMES.index(s) for s in census.silos)
        for c, count in enumerate(census.counts):
            equations[c].append((members, count))
    return equations, rows_released


def _recovered(equations: Equations, truth: np.ndarray) -> float:
    """Fraction of (silo, class) bits recovered correctly: those on which every 0/1 holding consistent with
    the released sums agrees (the strongest use of the sums, stronger than least squares)."""
    correct = sum(int((pinned(eqs, SILOS) == truth[:, c]).sum()) for c, eqs in enumerate(equations))
    return correct / truth.size


# --- (2) two attempts of one round --------------------------------------------------------------------------

FIRST, LATE = ("a", "b", "c"), "v"
RELEASE_SCHEMA = Schema((Field("delta", (16,), 1.0), Field("n", (), 100.0, frac_bits=0)))
CODEC_TOLERANCE = 1e-4  # a contribution recovered to within this is recovered (fixed point: 24 fraction bits)
SEED_WOBBLE = 1e-3  # how much a silo's contribution moves when it trains the same state with another seed
# what the aggregator may change between the attempts without changing the state silos train from (every
# second attempt has a new attempt number and round id too)
RELABELS = {
    "": {},
    "the plan's text with a comment appended": {"config_sha256": "plan, with a TOML comment"},
    "a new seed": {"seed": 1},
    "another round number": {"round": 2, "round_id": "r2.a2"},
}
# where only silos read the sums (blind), the silo the aggregator colludes with: a silo of every attempt and
# census here, holding the output key as every silo does
COLLUDER = "a"


@dataclass
class Attempt:
    """One attempt of the round, as the aggregator ended it, and what its attacker read of the sum."""

    released: Released | None
    refusals: dict[str, str]  # silo -> why it left the attempt
    aborted: str = ""  # why the sum failed, if it did
    census: Census | None = None  # the census the attacker read, if the attempt took one
    read: torch.Tensor | None = None  # the contribution sum as the attacker read it, if one was formed
    seen: torch.Tensor | None = None  # what the aggregator alone holds of it, decoded as if it were the sum


def _attacker(layer: str) -> tuple[str, str]:
    """Who mounts the attack under `layer`, as a mode's prefix and a finding's party: the aggregator where it
    reads the sums, else the aggregator with one silo, which reads them."""
    if make_layer(layer).silos_step:
        return f"{layer}, aggregator + silo {COLLUDER}: ", f"aggregator + 1 colluding silo ({COLLUDER})"
    return "", AGGREGATOR


def _labels(spec: round_pb2.RoundSpec) -> str:
    """The release key of silos that key by the RoundSpec's labels (fedlt before issue 30): the plan's hash
    and the seed are the aggregator's to choose."""
    return "/".join(
        map(str, (spec.consortium_id, spec.state_digest, spec.config_sha256, spec.seed, spec.round))
    )


def two_attempts(seed: int = 0, *, layer: str = "secagg") -> list[Finding]:
    """Runs round 1 over {a, b, c}, aborts after the sum, and runs it again over {a, b, c, v}: as the same
    RoundSpec against silos that forget what they signed, and relabelled (a comment in the plan, a new seed,
    another round) against silos that key their ledger by those labels; each then against the silos' release
    gate, keyed by the state they train from. Where only silos read the sums (blind), also what the aggregator
    alone gets from silos that forget: two totals whose difference is noise."""
    truth = _release_values(LATE, seed, seed)["delta"]
    findings = []
    with tempfile.TemporaryDirectory(prefix="fedlt-two-attempts-") as root:
        for relabel, change in RELABELS.items():
            for naive in (True, False):
                where = Path(root) / f"{bool(relabel)}-{relabel[:12]}-{naive}"
                first, second = _subtraction(
                    where, change, naive=naive and not relabel, seed=seed, labels=naive, layer=layer
                )
                if naive:
                    findings.append(_difference_finding(first, second, truth, relabel, layer))
                    if not relabel and make_layer(layer).silos_step:
                        findings.append(_alone_finding(first, second, truth, layer))
                else:
                    findings.append(_ledger_finding(first, second, relabel, layer))
    return findings


def _release_values(silo: str, seed: int, training_seed: int) -> dict[str, torch.Tensor]:
    """A silo's contribution to round 1: the same in every attempt of the same RoundSpec, as a deterministic
    training gives; trained with another seed, it moves by about `SEED_WOBBLE`."""
    index = (*FIRST, LATE).index(silo)
    generator = torch.Generator().manual_seed(1000 * seed + index + 1)
    delta = torch.rand(16, generator=generator, dtype=torch.float64) - 0.5
    if training_seed != seed:
        wobble = torch.Generator().manual_seed(1000 * training_seed + index + 7)
        delta += SEED_WOBBLE * torch.randn(16, generator=wobble, dtype=torch.float64)
    return {"delta": delta, "n": torch.tensor(float(10 + index), dtype=torch.float64)}


def _subtraction(
    root: Path, change: Mapping[str, object], *, naive: bool, seed: int, labels: bool, layer: str
) -> tuple[Attempt, Attempt]:
    """The malicious aggregator's two attempts, the second with the RoundSpec's labels changed as `change`
    says; a `naive` silo's ledger is deleted in between, and with `labels` silos key it by the labels."""
    keys = {u: ec.generate_private_key(ec.SECP256R1()) for u in (*FIRST, LATE)}
    peers = KeyPeers({u: k.public_key() for u, k in keys.items()})
    secret = _layer_key(layer)
    for u in keys:
        (root / u).mkdir(parents=True)
    first = _attempt(1, FIRST, keys, peers, root, seed, {}, labels=labels, layer=layer, secret=secret)
    if naive:
        for u in FIRST:
            (root / u / LEDGER).unlink(missing_ok=True)
    second = _attempt(
        2, (*FIRST, LATE), keys, peers, root, seed, change, labels=labels, layer=layer, secret=secret
    )
    return first, second


def _layer_key(layer: str) -> object:
    """The consortium's key of a layer that asks for the key service (blind's output key), which every silo
    holds and the aggregator does not; None for a layer without one."""
    kind = record(layer).key_service
    return None if kind is None else kind.new()


def _attempt(
    attempt: int,
    silos: Sequence[str],
    keys: Mapping[str, ec.EllipticCurvePrivateKey],
    peers: KeyPeers,
    root: Path,
    seed: int,
    change: Mapping[str, object],
    *,
    labels: bool,
    layer: str,
    secret: object,
) -> Attempt:
    """One attempt of round 1 with each silo's contribution; the state every attempt starts from is the
    same (`state_digest`, as the silo checks it)."""
    spec = _round_spec(attempt, silos, RELEASE_SCHEMA, seed, change, layer=layer)
    values = {u: RELEASE_SCHEMA.flatten(_release_values(u, seed, spec.seed)) for u in silos}
    trained_from = _labels(spec) if labels else spec.state_digest
    return _run(spec, values, keys, peers, root, ReleaseGate, trained_from, secret=secret)


def _round_spec(
    attempt: int,
    silos: Sequence[str],
    schema: Schema,
    seed: int,
    change: Mapping[str, object],
    *,
    layer: str = "secagg",
) -> round_pb2.RoundSpec:
    """Round 1's RoundSpec as the aggregator signs it, with the labels `change` names changed."""
    spec = round_pb2.RoundSpec(
        consortium_id="audit",
        round=1,
        attempt=attempt,
        round_id=f"r1.a{attempt}",
        config_sha256="plan",
        state_digest="state-of-round-1",
        seed=seed,
        schema=schema_to_pb(schema),
        privacy=layer,
        participants=sorted(silos),
        **_parameters(layer),
    )
    for name, value in change.items():
        setattr(spec, name, seed + value if name == "seed" else value)
    return spec


def _parameters(layer: str) -> dict[str, object]:
    """The layer's parameters in a RoundSpec, at its defaults with the tail guard at k_min = 2: in fields of
    its own (secagg), or its settings carried by name."""
    found = record(layer)
    settings = found.settings(k_min=2)
    if found.parameters is not None:
        return found.parameters.write(settings)
    return {"layer_parameters": entries_of(settings)}


def _run(
    spec: round_pb2.RoundSpec,
    values: Mapping[str, torch.Tensor],
    keys: Mapping[str, ec.EllipticCurvePrivateKey],
    peers: KeyPeers,
    root: Path,
    gate: Callable[..., ReleaseGate],
    trained_from: str,
    *,
    secret: object = None,
) -> Attempt:
    """One attempt under the layer the RoundSpec names: each silo's own `Participation` (policy, `gate`,
    ledger in `root`, the layer's `secret`) and the real round driver on the aggregator's side, every message
    delivered at once; a silo that raises leaves it."""
    signed = round_pb2.SignedRoundSpec(spec=spec.SerializeToString())  # silos check its signature elsewhere
    layer = make_layer(spec.privacy)
    ledgers = {u: ReleaseLedger(root / u) for u in values}
    parts = {
        u: Participation(
            spec,
            roundspec.sums_of(signed, spec),
            vector,
            me=u,
            side=layer.silo_side(
                PartyKeys(sign=partial(sign, keys[u]), peers=peers, policy=SessionPolicy(), secret=secret)
            ),
            gate=gate(consortium="audit", floors=Floors(), members=lambda: keys, ledger=ledgers[u]),
            trained_from=trained_from,
            ledger=ledgers[u],
            transport=None,  # messages go straight to the aggregator below, not over gRPC
            on_sent=lambda *_: None,
        )
        for u, vector in values.items()
    }
    aggregator = AggregatorRound(
        layer.aggregator_side(PartyKeys(peers=peers)), roundspec.sums_of(signed, spec), min_contributors=3
    )
    refusals: dict[str, str] = {}
    seen: torch.Tensor | None = None

    def answer(silo: str, call: Callable[[], list[tuple[str, object]]]) -> list[tuple[str, str, object]]:
        if silo in refusals:
            return []
        try:
            return [(silo, purpose, message) for purpose, message in call()]
        except FedltError as exc:  # the agent's reaction: leave this attempt's sums
            refusals[silo] = str(exc)
            return []

    def ended(released: Released | None, aborted: str = "") -> Attempt:
        colluder = parts.get(COLLUDER)
        census = aggregator.census_taken or (colluder.sums.census if colluder is not None else None)
        if released is not None and released.total is not None:
            return Attempt(released, refusals, aborted, census, released.total, released.total)
        read = None if colluder is None or COLLUDER in refusals else colluder.sums.result
        return Attempt(released, refusals, aborted, census, read, seen)

    inbox = [m for u, part in parts.items() for m in answer(u, part.sums.start)]
    while True:
        for silo, purpose, message in inbox:
            aggregator.receive(silo, purpose, message)
        try:
            out = aggregator.close()
        except SumAborted as exc:
            return ended(None, str(exc))
        if isinstance(out, Released):
            return ended(out)
        seen = _seen(aggregator, out) if aggregator.purpose == "contribution" else seen
        inbox = [m for u, purpose, step in out for m in answer(u, partial(parts[u].sums.step, purpose, step))]


def _seen(aggregator: AggregatorRound, out: list[tuple[str, str, object]]) -> torch.Tensor | None:
    """The total a blind aggregator hands the silos (the sum under every survivor's output mask), decoded as
    if it were the sum: the aggregator's best reading of it without the key."""
    totals = {step.total for _, _, step in out if isinstance(step, BlindTotal)}
    if not totals:
        return None
    (total,) = totals
    return codec_of(aggregator.half.spec).decode(np.frombuffer(total, dtype=np.uint8).copy())


def _delta(read: torch.Tensor | None) -> torch.Tensor | None:
    return None if read is None else RELEASE_SCHEMA.unflatten(read)["delta"]


def _target(relabel: str) -> str:
    second = f"the second relabelled: {relabel}" if relabel else "the second the same RoundSpec"
    return f"silo {LATE}'s contribution to round 1, as the difference of two attempts' sums ({second})"


def _error(first: torch.Tensor | None, second: torch.Tensor | None, truth: torch.Tensor) -> float:
    one, two = _delta(first), _delta(second)
    return float("nan") if one is None or two is None else float((two - one - truth).abs().max())


def _difference_finding(
    first: Attempt, second: Attempt, truth: torch.Tensor, relabel: str, layer: str
) -> Finding:
    error = _error(first.read, second.read, truth)
    # a new seed moves every silo's contribution a little: the difference is v's input to within that
    tolerance = 10 * SEED_WOBBLE * len(FIRST) if "seed" in relabel else CODEC_TOLERANCE
    leaked = error <= tolerance  # False for NaN
    prefix, party = _attacker(layer)
    return Finding(
        attack="protocol: two attempts",
        mode=prefix
        + (
            f"ledger keyed by the RoundSpec's labels ({relabel})"
            if relabel
            else "silos without a release ledger"
        ),
        party=party,
        target=_target(relabel),
        metrics={
            "max_abs_error": error,
            "contribution_max_abs": float(truth.abs().max()),
            "second_sums_formed": float(second.read is not None),
            "recovered": float(leaked),
        },
        leaked=leaked,
        audited=False,
        note=(
            "each silo keys its ledger by plan hash, seed and round, which the aggregator chooses"
            if relabel
            else "each silo's ledger file was deleted between the attempts (a silo forgetting what it signed)"
        ),
    )


def _alone_finding(first: Attempt, second: Attempt, truth: torch.Tensor, layer: str) -> Finding:
    """The aggregator alone against silos that forget: both totals were formed, each under the fresh output
    masks of its attempt's survivors, so their difference is noise, not v's contribution. Scored by the
    share of v's coordinates it gives to within the codec's precision (the error itself is the masks' noise,
    new every run)."""
    one, two = _delta(first.seen), _delta(second.seen)
    hits = (
        float("nan")
        if one is None or two is None
        else float(((two - one - truth).abs() <= CODEC_TOLERANCE).double().mean())
    )
    leaked = hits > 0  # False for NaN
    return Finding(
        attack="protocol: two attempts",
        mode=f"{layer}, the aggregator alone: silos without a release ledger",
        party=AGGREGATOR,
        target=_target(""),
        metrics={
            "coordinates_recovered": hits,
            "second_sums_formed": float(two is not None),
            "recovered": float(leaked),
        },
        leaked=leaked,
        audited=True,
        note="each silo's ledger file was deleted between the attempts, and both totals were handed out; "
        "their difference is the output masks' noise: the aggregator holds no key to remove them",
    )


def _ledger_finding(first: Attempt, second: Attempt, relabel: str, layer: str) -> Finding:
    refusing = sorted(u for u, why in second.refusals.items() if "subtract" in why)
    why = second.refusals[refusing[0]] if refusing else "no silo refused"
    formed = second.read is not None
    prefix, party = _attacker(layer)
    return Finding(
        attack="protocol: two attempts",
        mode=prefix + "silo release gate" + (f" ({relabel})" if relabel else ""),
        party=party,
        target=_target(relabel),
        metrics={
            "first_sums_formed": float(first.read is not None),
            "second_sums_formed": float(formed),
            "silos_refusing": float(len(refusing)),
            "recovered": float(formed),
        },
        leaked=formed,
        audited=True,
        note=f"silo {refusing[0] if refusing else '-'} refused: {why}; the attempt aborted: {second.aborted}",
    )


# --- (2b) one census per silo set, whatever its labels ------------------------------------------------------

CENSUS_SILOS = ("a", "b", "c", "d")


class _LabelledGate(ReleaseGate):
    """For contrast, the gate of fedlt before issue 30: a census keyed by the RoundSpec's labels (consortium,
    plan hash, seed, round), which the aggregator chooses, not by the presence the silo sends."""

    def __init__(self, *, labels: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.labels = labels

    def release(
        self, spec: SumSpec, side: SiloSide, survivors: Sequence[str], subject: Subject | None
    ) -> None:
        if subject is not None and subject.kind == "census":
            subject = Subject("census", self.labels.encode())
        super().release(spec, side, survivors, subject)


def census_relabels(seed: int = 0, *, layer: str = "secagg") -> list[Finding]:
    """A census over four silos, then one over each leave-one-out set, each under a new seed (the same state):
    the differences are each silo's presence vector. Against silos keying the census by labels, then
    against the release gate, which keys it by the presence sent: one silo set per presence. Where only silos
    read the census (blind), the attacker reads it through silo `COLLUDER`, so not the census without it."""
    rng = np.random.default_rng([seed, 2])
    truth = (rng.random((len(CENSUS_SILOS), CLASSES)) < 0.5).astype(np.int64)
    keys = {u: ec.generate_private_key(ec.SECP256R1()) for u in CENSUS_SILOS}
    peers = KeyPeers({u: k.public_key() for u, k in keys.items()})
    secret = _layer_key(layer)
    sets = [CENSUS_SILOS, *(tuple(v for v in CENSUS_SILOS if v != u) for u in CENSUS_SILOS)]
    findings = []
    with tempfile.TemporaryDirectory(prefix="fedlt-census-relabels-") as root:
        for labelled in (True, False):
            where = Path(root) / str(labelled)
            for u in CENSUS_SILOS:
                (where / u).mkdir(parents=True)
            censuses: dict[tuple[str, ...], Census] = {}
            refusals: list[str] = []
            for i, silos in enumerate(sets):
                # a new seed each time
                spec = _round_spec(i + 1, silos, PRESENCE_SCHEMA, seed, {"seed": i}, layer=layer)
                values = {
                    u: PRESENCE_SCHEMA.flatten(
                        {
                            "delta": torch.from_numpy(np.random.default_rng([seed, i, k]).normal(size=4)),
                            "present": torch.from_numpy(truth[k].astype(np.float64)),
                        }
                    )
                    for k, u in enumerate(CENSUS_SILOS)
                    if u in silos
                }
                gate = partial(_LabelledGate, labels=_labels(spec)) if labelled else ReleaseGate
                trained_from = _labels(spec) if labelled else spec.state_digest
                attempt = _run(spec, values, keys, peers, where, gate, trained_from, secret=secret)
                refusals += list(attempt.refusals.values())
                if attempt.census is not None:
                    censuses[attempt.census.silos] = attempt.census
            findings.append(_census_finding(truth, censuses, refusals, labelled=labelled, layer=layer))
    return findings


def _census_finding(
    truth: np.ndarray,
    censuses: Mapping[tuple[str, ...], Census],
    refusals: list[str],
    *,
    labelled: bool,
    layer: str,
) -> Finding:
    """Each silo's presence as the full census minus the census without it; bits beyond what the full
    census's counts alone imply (a class none or all of the silos hold) are the leak. `censuses` are those
    the attacker read (under blind, those of sets with silo `COLLUDER`)."""
    full = censuses.get(CENSUS_SILOS)
    known = np.zeros(truth.shape, dtype=bool)
    if full is not None:
        counts = np.asarray(full.counts)
        known[:, (counts == 0) | (counts == len(CENSUS_SILOS))] = True  # every silo agrees on these
    implied = int(known.sum())
    for k, u in enumerate(CENSUS_SILOS):
        without = censuses.get(tuple(v for v in CENSUS_SILOS if v != u))
        if full is not None and without is not None:
            known[k] |= counts - np.asarray(without.counts) == truth[k]
    recovered = int(known.sum())
    refused = next((r for r in refusals if "subtract" in r), "")
    prefix, party = _attacker(layer)
    return Finding(
        attack="protocol: census relabelled",
        mode=prefix + ("census keyed by the RoundSpec's labels" if labelled else "silo release gate"),
        party=party,
        target=f"each of {len(CENSUS_SILOS)} silos' class presence, from censuses over leave-one-out sets, "
        "each under a new seed",
        metrics={
            "censuses_formed": float(len(censuses)),
            "bits_recovered": recovered / truth.size,
            "bits_from_one_census": implied / truth.size,
        },
        leaked=recovered > implied,
        audited=not labelled,
        note=f"refused: {refused}" if refused else "every census formed",
    )


# --- (3) split views and weak sessions ----------------------------------------------------------------------

RING = Ring(8)  # wide words only: inputs and sums read as uint64
POLICY = SessionPolicy()


def split_views(seed: int = 0) -> list[Finding]:
    """The split-view attack mounted on a bare majority and on the default threshold, the silo policy's
    refusal of every weak session, and the clients' refusal of key lists that differ between silos."""
    findings = []
    bare = SessionSpec("r1.a1", "contribution", _ids(5), RING, threshold=3)
    findings.append(_split_view_finding(bare, 1, "silos without a session policy", audited=False, seed=seed))
    findings.append(_policy_finding("a bare-majority threshold, where one colluder splits views", bare))
    default = SessionSpec("r1.a1", "contribution", _ids(5), RING)
    below_bound = 2 * default.t - len(default.participants) - 1  # one colluder fewer than 2t − n
    findings.append(_split_view_finding(default, below_bound, "silo session policy", audited=True, seed=seed))
    findings.append(_two_silos_contrast(seed))
    weak = [
        (
            "two silos: the sum minus one's own input is the other's",
            SessionSpec("r", "contribution", _ids(2), Ring(1)),
        ),
        (
            "threshold 6 of 9, two thirds and not above",
            SessionSpec("r", "contribution", _ids(9), RING, threshold=6),
        ),
        (
            "a SecAgg+ graph of 2 neighbours over 12 silos, which a colluder could steer",
            SessionSpec("r", "contribution", _ids(12), RING, neighbours=2),
        ),
        (
            "a census on a 2-neighbour graph with threshold 2",
            SessionSpec("r", "census", _ids(12), RING, neighbours=2, threshold=2),
        ),
    ]
    findings += [_policy_finding(target, spec) for target, spec in weak]
    findings += _key_list_findings(seed)
    return findings


# the aggregator's choice of key list for each silo: (silo, every key advertised) -> the list it is shown
Tamper = Callable[[str, list[AdvertisedKeys]], list[AdvertisedKeys]]
# keys advertised, masked inputs, each masking silo's survivor view, refusals
Stages = tuple[dict[str, AdvertisedKeys], dict[str, np.ndarray], dict[str, tuple[str, ...]], dict[str, str]]


def _ids(n: int) -> tuple[str, ...]:
    return tuple(f"silo-{i:02d}" for i in range(n))


@dataclass
class _Silos:
    """The real clients of one session, their signing keys and inputs; the aggregator's relaying is ours."""

    spec: SessionSpec
    keys: dict[str, ec.EllipticCurvePrivateKey]
    clients: dict[str, SecAggClient]
    inputs: dict[str, np.ndarray]
    sent: dict[str, list[Envelope]] = field(default_factory=dict)  # what the aggregator relayed in stage 1

    @classmethod
    def of(cls, spec: SessionSpec, seed: int) -> _Silos:
        keys = {u: ec.generate_private_key(ec.SECP256R1()) for u in spec.participants}
        peers = KeyPeers({u: k.public_key() for u, k in keys.items()})
        clients = {u: SecAggClient(spec, u, sign=partial(sign, k), peers=peers) for u, k in keys.items()}
        rng = np.random.default_rng(seed)
        inputs = {u: RING.random(rng) for u in spec.participants}
        return cls(spec, keys, clients, inputs)

    def through_masked(self, shown: Tamper = lambda _, keys: keys) -> Stages:
        """Stages 0–2 relayed by the aggregator, each silo shown `shown(silo, every key)` as the key list and,
        to keep its view consistent, only the silos of that list as survivors: the keys advertised, the
        masked inputs, each silo's survivor view, and why each silo that stopped did."""
        advertised = {u: c.advertise() for u, c in self.clients.items()}
        refusals: dict[str, str] = {}
        sent, lists = self.sent, {}
        for u, client in self.clients.items():
            lists[u] = shown(u, list(advertised.values()))
            try:
                sent[u] = client.share(lists[u])
            except SecAggError as exc:
                refusals[u] = str(exc)
        masked, views = {}, {}
        for u in sent:
            views[u] = tuple(v for v in sent if v in {k.silo for k in lists[u]})
            inbox = Inbox(views[u], tuple(e for s in views[u] for e in sent[s] if e.recipient == u))
            try:
                masked[u] = self.clients[u].masked_input(inbox, self.inputs[u])
            except SecAggError as exc:
                refusals[u] = str(exc)
        return advertised, masked, {u: v for u, v in views.items() if u in masked}, refusals

    def reveal(self, views: Mapping[str, tuple[str, ...]], refusals: dict[str, str]) -> set[str]:
        """Stages 3–4 for the silos that masked: each signs the survivors of its own view and is given the
        signatures of that view's silos. Returns the silos that verified them and revealed shares."""
        masked = set(views)
        signed = {}
        for u, view in views.items():
            try:
                signed[u] = self.clients[u].consistency(tuple(sorted(masked & set(view))))
            except SecAggError as exc:
                refusals[u] = str(exc)
        revealed = set()
        for u in signed:
            try:
                self.clients[u].unmask({v: signed[v] for v in self.clients[u].survivors if v in signed})
                revealed.add(u)
            except SecAggError as exc:
                refusals[u] = str(exc)
        return revealed


def _split_view(spec: SessionSpec, colluders: int, seed: int) -> bool:
    """Whether the aggregator and `colluders` silos rebuild the victim's input: it tells just enough honest
    silos that the victim survived (they reveal its self-mask shares) and the rest that it dropped out (they
    reveal its mask-key shares); colluders sign both views and hand over both shares they hold."""
    silos = _Silos.of(spec, seed)
    advertised, masked, _, _ = silos.through_masked()
    ids, t = spec.participants, spec.t
    victim, bad, honest = ids[0], ids[1 : 1 + colluders], ids[1 + colluders :]
    alive = honest[: max(0, t - colluders - 1)]
    dropped = honest[len(alive) :]
    keyed = silos.clients[victim].spec  # the session with the key list every silo checked
    b_shares: dict[int, int] = {}
    s_shares: dict[int, int] = {}
    for u in bad:
        b, s = silos.clients[u]._held[victim]  # a colluder keeps what it was sealed
        b_shares[keyed.x_of(victim, u)], s_shares[keyed.x_of(victim, u)] = b, s
    for view, members in (
        (sorted({victim, *alive, *bad}), (victim, *alive)),
        (sorted({*dropped, *bad}), dropped),
    ):
        message = keyed.consistency_message(view)
        signatures = {u: sign(silos.keys[u], message, context=CONSISTENCY_CONTEXT) for u in bad}
        signers = []
        for u in members:
            try:
                signatures[u] = silos.clients[u].consistency(view)
                signers.append(u)
            except SecAggError:  # a view too small to sign
                continue
        for u in signers:
            try:
                reveal = silos.clients[u].unmask(signatures)
            except SecAggError:  # too few signatures on its view
                continue
            if victim in reveal.self_mask:
                b_shares[keyed.x_of(victim, u)] = int.from_bytes(reveal.self_mask[victim], "big")
            if victim in reveal.mask_key:
                s_shares[keyed.x_of(victim, u)] = int.from_bytes(reveal.mask_key[victim], "big")
    if len(b_shares) < t or len(s_shares) < t:
        return False
    b_victim = shamir.combine(b_shares, threshold=t)
    s_victim = crypto.private_key_from(shamir.combine(s_shares, threshold=t))
    unmasked = masked[victim].copy()
    masks = [(b_victim, True)]  # the victim added PRG(b), and subtracted PRG(s_uv) for each u above it
    masks += [(pair_seed(keyed, s_victim, victim, advertised[u].s_public, u), victim > u) for u in ids[1:]]
    apply_masks(keyed.ring, unmasked, masks)
    return bool(np.array_equal(unmasked, silos.inputs[victim]))


def _colluders_needed(spec: SessionSpec, seed: int) -> int:
    """The fewest colluders with which the split-view attack succeeds (n if none does)."""
    n = len(spec.participants)
    return next((c for c in range(n - 1) if _split_view(spec, c, seed)), n)


def _split_view_finding(spec: SessionSpec, colluders: int, mode: str, *, audited: bool, seed: int) -> Finding:
    n, t = len(spec.participants), spec.t
    recovered = _split_view(spec, colluders, seed)
    return Finding(
        attack="protocol: split views",
        mode=mode,
        party=f"aggregator + {colluders} colluding silo(s)",
        target=f"the victim's input, split views at threshold {t} of {n} with {colluders} colluder(s)",
        metrics={
            "silos": float(n),
            "threshold": float(t),
            "colluders": float(colluders),
            "colluders_needed": float(_colluders_needed(spec, seed)),
            "recovered": float(recovered),
        },
        leaked=recovered,
        audited=audited,
        note=(
            "accepted: no policy checks the threshold"
            if not audited
            else "the policy accepts this session; honest silos reveal only after t signatures on their own "
            "view, so the attack needs 2t − n colluders (the documented bound)"
        ),
    )


def _policy_finding(target: str, spec: SessionSpec) -> Finding:
    """A weak session put to the default silo policy: refused is no leak."""
    try:
        POLICY.check(spec)
        refusal = ""
    except PolicyRefusal as exc:
        refusal = str(exc)
    return Finding(
        attack="protocol: split views",
        mode="silo session policy",
        party=AGGREGATOR,
        target=f"a weak session: {target}",
        metrics={
            "silos": float(len(spec.participants)),
            "threshold": float(spec.t),
            "refused": float(bool(refusal)),
            "recovered": 0.0,
        },
        leaked=not refusal,
        audited=True,
        note=f"refused: {refusal}" if refusal else "accepted by the default policy",
    )


def _two_silos_contrast(seed: int) -> Finding:
    """A two-silo sum run to the end (no policy): one silo's input is the sum minus the other's."""
    spec = SessionSpec("r", "contribution", _ids(2), RING)
    rng = np.random.default_rng(seed)
    inputs = {u: RING.random(rng) for u in spec.participants}
    total, _ = run_session(spec, inputs)
    mine, other = spec.participants
    recovered = bool(np.array_equal(total.view("<u8") - inputs[mine].view("<u8"), inputs[other].view("<u8")))
    return Finding(
        attack="protocol: split views",
        mode="silos without a session policy",
        party="aggregator + 1 colluding silo",
        target="a weak session: two silos: the sum minus one's own input is the other's",
        metrics={"silos": 2.0, "threshold": float(spec.t), "recovered": float(recovered)},
        leaked=recovered,
        audited=False,
        note="accepted: the secure sum of two completes, and reveals the other silo's input to either",
    )


def _key_list_findings(seed: int) -> list[Finding]:
    """Key lists that differ between silos (a peer left out of one silo's list), or that carry keys the
    aggregator made in a victim's name: a silo shown one must stop before it reveals any share for that view
    (substituted keys fail their signature at once; an omitted peer, at the consistency signatures)."""
    spec = SessionSpec("r1.a1", "contribution", _ids(4), RING)

    def omit(silo: str, keys: list[AdvertisedKeys]) -> list[AdvertisedKeys]:
        return [k for k in keys if k.silo != "silo-02"] if silo == "silo-03" else keys

    c, s = crypto.new_private_key(), crypto.new_private_key()
    fake = AdvertisedKeys("silo-00", crypto.public_bytes(c), crypto.public_bytes(s), b"")
    made_up = ec.generate_private_key(ec.SECP256R1())  # the aggregator's: no silo's certificate key
    fake = replace(fake, signature=sign(made_up, spec.key_message(fake), context=KEYS_CONTEXT))

    deceived = ("silo-01", "silo-02")

    def substitute(silo: str, keys: list[AdvertisedKeys]) -> list[AdvertisedKeys]:
        return [fake if k.silo == "silo-00" else k for k in keys] if silo in deceived else keys

    def opened(silos: _Silos, advertised: Mapping[str, AdvertisedKeys]) -> int:
        """Envelopes sealed to silo-00 under the planted key that the aggregator opens: each holds shares of
        both seeds of its sender (the envelope key and binding re-derived as a holder derives them)."""
        count = 0
        for sender in deceived:
            for envelope in silos.sent.get(sender, []):
                if envelope.recipient != "silo-00":
                    continue
                pair = ("silo-00", sender)
                key = crypto.agree(
                    c,
                    advertised[sender].c_public,
                    purpose=ENVELOPE_PURPOSE,
                    session=spec.session,
                    pair=pair,
                )
                try:
                    crypto.open_sealed(
                        key, envelope.ciphertext, crypto.transcript(spec.session, sender, pair[0])
                    )
                    count += 1
                except crypto.CryptoError:
                    continue
        return count

    return [
        _key_finding("silo-03 shown a key list without silo-02", spec, omit, {"silo-03"}, seed),
        _key_finding(
            "silo-00's keys replaced by the aggregator's in the lists of silo-01 and silo-02",
            spec,
            substitute,
            set(deceived),
            seed,
            opened=opened,
        ),
    ]


def _key_finding(
    target: str,
    spec: SessionSpec,
    shown: Tamper,
    deceived: set[str],
    seed: int,
    *,
    opened: Callable[[_Silos, Mapping[str, AdvertisedKeys]], int] = lambda *_: 0,
) -> Finding:
    """A leak when a silo shown a tampered list reveals shares (it masked and signed for another view than
    its peers', the split the aggregator wants) or seals shares to a key the aggregator made (`opened`)."""
    silos = _Silos.of(spec, seed)
    advertised, masked, views, refusals = silos.through_masked(shown)
    revealed = silos.reveal(views, refusals)
    stolen = opened(silos, advertised)
    split = bool(deceived & revealed) or stolen > 0
    first = min(deceived & set(refusals), default="")
    return Finding(
        attack="protocol: split views",
        mode="secagg client checks",
        party=AGGREGATOR,
        target=f"different key lists shown to different silos: {target}",
        metrics={
            "silos": float(len(spec.participants)),
            "silos_refusing": float(len(refusals)),
            "masked_inputs_sent": float(len(masked)),
            "deceived_silos_revealing": float(len(deceived & revealed)),
            "envelopes_opened_by_aggregator": float(stolen),
            "recovered": float(split),
        },
        leaked=split,
        audited=True,
        note=f"{first} refused: {refusals[first]}" if first else "no deceived silo refused",
    )
