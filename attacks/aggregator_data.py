"""Audit a real aggregator: the attacks run on what a deployment's database actually keeps.

An operator points `audit_aggregator_data` at the aggregator's data folder (`server.data_dir` of
consortium.toml); its SQLite database (`aggregator.store.DATABASE`) is opened read-only, never through
`Store`, which creates the file and writes to it. What the store keeps, and so what is attacked:

- states: the committed global states `[retention]` keeps (the last 3 by default; others are blanked; a state
  sealed by the silos, under ckks, is unreadable here). RedGrape's keeps `prototypes`: each class's released
  head-gradient sum divided by the silos that held it (its Eq. 10). Attack (a), `recover_feature` on a class's
  rows, gives the mean feature of those silos, one silo's when one held it; all-zero rows were withheld by the
  tail guard or held by nobody. The `present` sum is not stored, so the number of holders is known only where
  the tail guard ran (its audit record: every released class had at least k_min) or one silo contributed; a
  released class of an unguarded round is flagged, since nothing shows it was not one silo's.
- disclosures: each silo's latest MFSC masked class means, attacked with `presence_scores` against the model
  the silos computed them on (the state before their round), given public data.

Not stored, so not attacked: the released sums themselves (a round's `grad`, `present`, and CCVR/DFL-FS/SFD's
Σz, Σzzᵀ and counts feed the server step and are dropped; those methods' states keep only the re-trained
head, so `invert_moments` has nothing to run on), CReFF's per-class gradients (its state keeps the federated
features matched to them), and silos' contributions. No original images exist here, so a finding's images
are the recovered ones only (`images["recovered"]`).

`describe_store` heads the report with the consortium (its id, method, layer and rounds, from the
consortium.toml the store is bound to) and what the store holds; where no attack applies (FedAvg keeps
neither), it says why, and the audit's verdict is NOTHING AUDITED, never PASSED.
"""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from aggregator.config import ConsortiumConfig, load_consortium_config
from aggregator.held_state import SEALED
from aggregator.store import DATABASE
from attacks.analytic import recover_feature
from attacks.audit import Finding
from attacks.census_bits import MAX_SILOS, pinned_beyond_each
from attacks.config import Thresholds
from attacks.decoder import FeatureDecoder, decode, train_decoder
from attacks.feature_inversion import invert_features
from attacks.presence import presence_report, presence_scores
from attacks.report import Subject
from fedlt.data.arrays import LabeledData
from fedlt.errors import FedltError
from fedlt.methods import ModelSpec
from fedlt.methods.state import GlobalState, unpack_state
from fedlt.models import MODELS, SplitModel
from fedlt.selection import DISCLOSURE
from fedlt.tensorpack import PackError

TABLES = frozenset({"meta", "attempts", "states", "disclosures", "censuses", "audit"})
CONSORTIUM_TOML = "consortium.toml"  # where the demo and the operator guide keep it: beside server.data_dir
NEVER_STORED = "the released sums and the silos' contributions are never stored"
# how the store keeps a committed round's state
CLEAR, SEALED_BY_SILOS, BLANKED = "in the clear", "sealed by the silos (ckks)", "blanked by [retention]"
PARTY = "whoever reads the aggregator's database"
# each detector's own cut between "real mean" and "mask" (`presence_scores`); cosine has none
CALLS_REAL: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "margin": lambda s: s > 0,  # the head classifies the disclosed row as its own class
    "norm": lambda s: s >= 0,  # its norm lies in the range a real mean's can have
    "clustering": lambda s: s > 0.5,  # MFSC's own estimate, which the aggregator picks silos by
}


class AggregatorDataError(FedltError):
    """The folder holds no aggregator database, or one this audit cannot read."""


@dataclass(frozen=True)
class StoredRound:
    """One round as the store keeps it; `state` is None where it was blanked or is sealed by the silos."""

    round: int
    round_id: str
    contributors: tuple[str, ...]
    state: GlobalState | None
    guard: dict | None  # the round's tail_guard audit record: k_min and the classes zeroed
    sealed: bool  # under ckks: only the silos can open the state


@dataclass(frozen=True)
class AggregatorData:
    rounds: dict[int, StoredRound]  # round 0 is the initial state, the model of round 1
    disclosures: dict[str, dict[str, np.ndarray]]  # round_id -> silo -> flat float64 class means
    database: Path  # resolved
    fingerprint: str  # of the consortium settings the store is bound to (`Store.bind`); "" if none
    censuses: dict[str, tuple[tuple[str, ...], list[int]]] = field(
        default_factory=dict
    )  # phase -> silos, counts


def read_aggregator_data(folder: Path) -> AggregatorData:
    """Everything the attacks use from the database in `folder`, read in one read-only connection.

    While the aggregator has the database open, its -wal and -shm files exist and are shared read-only.
    Without a -wal file no connection is open, and the file is read as immutable: a read-only connection
    would otherwise create -wal and -shm files owned by the auditing user, which can stop the aggregator's
    next start."""
    path = Path(folder) / DATABASE
    if not path.is_file():
        raise AggregatorDataError(
            f"no aggregator database in {folder}: {DATABASE} is not there "
            "(pass the folder that server.data_dir of consortium.toml names)"
        )
    try:
        live = path.with_name(f"{path.name}-wal").exists()
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro{'' if live else '&immutable=1'}", uri=True)
    except sqlite3.Error as exc:
        raise AggregatorDataError(f"cannot open {path} read-only: {exc}") from None
    try:
        return _read(db, path.resolve())
    except sqlite3.Error as exc:  # DatabaseError for a file that is not SQLite
        raise AggregatorDataError(f"{path} is not an aggregator database: {exc}") from None
    finally:
        db.close()


def _read(db: sqlite3.Connection, path: Path) -> AggregatorData:
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    missing = sorted(TABLES - tables)
    if missing:
        raise AggregatorDataError(f"{path} is not an aggregator database: no table {', '.join(missing)}")
    guards = {}
    for (detail,) in db.execute("SELECT detail FROM audit WHERE event = 'tail_guard' ORDER BY seq"):
        record = json.loads(detail)
        guards[record["round_id"]] = record
    rounds = {}
    for number, data, round_id, contributors in db.execute(
        "SELECT round, data, round_id, contributors FROM states ORDER BY round"
    ):
        state = _state(data, number, path)
        round_id = round_id or ""  # the initial state belongs to no round
        rounds[number] = StoredRound(
            number,
            round_id,
            tuple(json.loads(contributors)),
            state,
            guards.get(round_id),
            data.startswith(SEALED),
        )
    if not any(number >= 1 for number in rounds):
        raise AggregatorDataError(f"{path} holds no committed round: nothing was released yet")
    disclosures: dict[str, dict[str, np.ndarray]] = {}
    for silo, round_id, data in db.execute(
        "SELECT silo_id, round_id, data FROM disclosures WHERE name = ? ORDER BY silo_id", (DISCLOSURE,)
    ):
        disclosures.setdefault(round_id, {})[silo] = np.frombuffer(data, dtype="<f8").copy()
    bound = db.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone()
    censuses = {}
    for phase, silos, counts in db.execute("SELECT phase, silos, counts FROM censuses ORDER BY phase"):
        counts = json.loads(counts)  # a list; with a record floor, {"counts": [...], "records": [...]}
        censuses[phase] = (tuple(json.loads(silos)), counts["counts"] if isinstance(counts, dict) else counts)
    return AggregatorData(rounds, disclosures, path, bound[0] if bound else "", censuses)


def _state(data: bytes, number: int, path: Path) -> GlobalState | None:
    """The stored state in the clear, or None for a blanked (old) or sealed (ckks) one."""
    if not data or data.startswith(SEALED):
        return None
    try:
        return unpack_state(data, number)
    except PackError as exc:
        raise AggregatorDataError(f"{path}: the state of round {number} does not unpack: {exc}") from None


def describe_store(data: AggregatorData, settings: Path | None = None) -> Subject:
    """The report's header for a deployment audit: the consortium (from the consortium.toml the store was
    run with: `settings`, else one beside the data folder that names it) and what its store holds, and why
    no attack applies where none does."""
    config, source = _settings(data, settings)
    committed = max(data.rounds)
    facts: dict = {"database": str(data.database), "rounds_committed": committed, "settings": source}
    if config is None:
        who = f"Consortium settings unknown ({source}); {_count(committed, 'round')} committed."
    else:
        facts |= {
            "consortium": config.consortium.id,
            "method": config.plan.method.name,
            "privacy": config.consortium.privacy,
            "rounds": config.consortium.rounds,
        }
        who = (
            f"Consortium {config.consortium.id!r}: method {config.plan.method.name}, privacy layer "
            f"{config.consortium.privacy}, {committed} of {config.consortium.rounds} rounds committed "
            f"({source})."
        )
    holds = _holdings(data)
    facts["holds"] = holds
    header = f"{who} Data: the aggregator's store {data.database}, read-only; it holds {', '.join(holds)}."
    return Subject(header, _why_nothing_applies(data), facts)


def _settings(data: AggregatorData, given: Path | None) -> tuple[ConsortiumConfig | None, str]:
    """The consortium.toml the store is bound to, and where it came from; None and why when there is none.
    A file of other settings would describe another consortium: given, it is refused; found, passed over."""
    if given is not None:
        config = load_consortium_config(given)
        if config.fingerprint() != data.fingerprint:
            raise AggregatorDataError(
                f"{given} holds other settings than the ones {data.database} was run with (their "
                "fingerprint is not the one the store is bound to): pass the consortium.toml this "
                "aggregator serves with"
            )
        return config, f"settings from {Path(given).resolve()}, which the store is bound to"
    beside = data.database.parent.parent / CONSORTIUM_TOML
    hint = "pass --consortium with the consortium.toml the aggregator ran with to name them"
    if not beside.is_file():
        return None, f"no {CONSORTIUM_TOML} beside the data folder; {hint}"
    try:
        config = load_consortium_config(beside)
    except FedltError:
        return None, f"{beside} does not load; {hint}"
    if config.path(config.server.data_dir).resolve() != data.database.parent:
        return None, f"{beside} names another data folder; {hint}"
    if config.fingerprint() != data.fingerprint:
        return None, f"{beside} holds other settings than the store was run with; {hint}"
    return config, f"settings from {beside}, beside the data folder, which the store is bound to"


def _states(data: AggregatorData) -> dict[str, list[int]]:
    """The committed rounds by how the store keeps their state."""
    rounds = [stored for number, stored in sorted(data.rounds.items()) if number >= 1]
    return {
        CLEAR: [r.round for r in rounds if r.state is not None],
        SEALED_BY_SILOS: [r.round for r in rounds if r.sealed],
        BLANKED: [r.round for r in rounds if r.state is None and not r.sealed],
    }


def _holdings(data: AggregatorData) -> list[str]:
    """What the store keeps of its committed rounds, one phrase each."""
    states = _states(data)
    holds = [f"{_states_of(numbers)} {how}" for how, numbers in states.items() if numbers]
    gradients = _with_gradients(data)
    holds.append(
        f"per-class head gradients (RedGrape's prototypes) in {_rounds(gradients)}"
        if gradients
        else "no per-class head gradients"
    )
    silos = sorted({silo for disclosed in data.disclosures.values() for silo in disclosed})
    holds.append(
        f"MFSC disclosures of {_count(len(silos), 'silo')} from {_count(len(data.disclosures), 'round')}"
        if silos
        else "no MFSC disclosures"
    )
    holds.append(
        f"the census of {_count(len(data.censuses), 'phase')} ({', '.join(data.censuses)})"
        if data.censuses
        else "no census"
    )
    return holds


def _why_nothing_applies(data: AggregatorData) -> str:
    """Why neither attack on a store (per-class gradients in a state, MFSC disclosures) has anything here."""
    states = _states(data)
    reasons = []
    if states[CLEAR] and not _with_gradients(data):
        reasons.append(
            f"no per-class head gradients in {_states_of(states[CLEAR])} it keeps in the clear "
            "(RedGrape's prototypes are the only released statistic a state keeps)"
        )
    for how in (SEALED_BY_SILOS, BLANKED):
        if states[how]:
            reasons.append(f"{_states_of(states[how])}: {how}")
    if not data.disclosures:
        reasons.append("it holds no MFSC disclosures (the presence attack's input)")
    if not data.censuses:
        reasons.append("it holds no census (the presence intersection's input)")
    return "; ".join([*reasons, NEVER_STORED])


def _with_gradients(data: AggregatorData) -> list[int]:
    """The committed rounds whose state keeps per-class head gradients, the analytic attack's input."""
    return [
        number
        for number, stored in sorted(data.rounds.items())
        if number >= 1 and stored.state is not None and "prototypes" in stored.state.extra
    ]


def _rounds(numbers: list[int]) -> str:
    """Sorted round numbers in runs: [1, 2, 3, 5] -> 'rounds 1–3, 5'; [4] -> 'round 4'."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    spans = ", ".join(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"round {spans}" if len(numbers) == 1 else f"rounds {spans}"


def _states_of(numbers: list[int]) -> str:
    return f"the state{'s' if len(numbers) > 1 else ''} of {_rounds(numbers)}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def released_class_features(state: GlobalState) -> dict[int, torch.Tensor]:
    """Attack (a) on every class of a state's stored per-class head gradients (RedGrape's prototypes):
    the class's feature where its rows are non-zero; empty for states without them."""
    prototypes = state.extra.get("prototypes")
    if prototypes is None:
        return {}
    found = {c: recover_feature(rows) for c, rows in enumerate(prototypes)}
    return {c: feature for c, feature in found.items() if feature is not None}


def audit_aggregator_data(
    folder: Path,
    *,
    thresholds: Thresholds,
    public: LabeledData | None = None,
    holdings: Mapping[str, Collection[int]] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Finding]:
    """Findings on what the aggregator in `folder` stored: one per round with per-class head gradients, one
    per round of MFSC disclosures. `public` (the operator's own images, never silo data) lets the findings
    decode recovered features and score disclosures; `holdings`, which classes each silo disclosed a real
    mean of (at least `selection.min_samples` samples), if the operator asked the silos, scores the
    presence detectors against the truth, which otherwise nobody but the silos knows."""
    progress(f"reading {Path(folder) / DATABASE}")
    data = read_aggregator_data(folder)
    return audit_stored(data, thresholds=thresholds, public=public, holdings=holdings, progress=progress)


def audit_stored(
    data: AggregatorData,
    *,
    thresholds: Thresholds,
    public: LabeledData | None = None,
    holdings: Mapping[str, Collection[int]] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Finding]:
    """`audit_aggregator_data` on a store already read (`read_aggregator_data`), which `describe_store`
    describes: the findings and the description are of the same reading of a live store."""
    mode = f"deployment: {data.database.parent.name}"
    models = _Models(data, public, progress)
    findings = []
    for number in _with_gradients(data):
        progress(f"round {number}: per-class head gradients")
        findings.append(_gradient_finding(data.rounds[number], models, mode))
    for round_id, disclosed in sorted(data.disclosures.items()):
        progress(f"{round_id}: MFSC disclosures of {len(disclosed)} silos")
        findings.append(_presence_finding(round_id, disclosed, models, mode, thresholds, holdings))
    if data.censuses:
        progress(f"the {_count(len(data.censuses), 'census')} kept: presence intersection")
        findings.append(_census_finding(data.censuses, mode))
    return findings


class _Models:
    """The model the silos received in each round, and a decoder on its encoder, built once each."""

    def __init__(
        self, data: AggregatorData, public: LabeledData | None, progress: Callable[[str], None]
    ) -> None:
        self.data = data
        self.public = public
        self.progress = progress
        self._models: dict[int, SplitModel | None] = {}
        self._decoders: dict[int, FeatureDecoder] = {}

    def received(self, number: int) -> SplitModel | None:
        """Round `number`'s model (the state before it); None without public data (which fixes the image
        shape) or when that state is no longer stored or fits no registered network."""
        if number not in self._models:
            before = self.data.rounds.get(number - 1)
            readable = self.public is not None and before is not None and before.state is not None
            self._models[number] = _network(before.state.model, self.public) if readable else None
        return self._models[number]

    def decoder(self, number: int) -> FeatureDecoder | None:
        model = self.received(number)
        if model is None or self.public is None:
            return None
        if number not in self._decoders:
            self.progress(f"training a decoder on the public data under round {number}'s model")
            self._decoders[number] = train_decoder(model, self.public)
        return self._decoders[number]

    def why_not(self, number: int) -> str:
        if self.public is None:
            return "no public data given"
        before = self.data.rounds.get(number - 1)
        if before is None or before.state is None:
            return f"the model of round {number} (state {number - 1}) is blanked or sealed by the silos"
        return (
            f"the stored weights fit no registered model for {self.public.num_classes} classes of "
            f"{self.public.input_shape} images"
        )


def _network(weights: Mapping[str, torch.Tensor], public: LabeledData) -> SplitModel | None:
    """The registered network the stored weights fit (the store does not name it), with those weights;
    extra entries (RedGrape's supplementary head) are left out."""
    side = public.input_shape[1]
    for name, entry in MODELS.items():
        if side not in entry.sides:
            continue
        spec = ModelSpec(name, public.input_shape, public.num_classes)
        for private in (False, True):  # under DP a BatchNorm network trains with GroupNorm instead
            model = replace(spec, private=private).build(0)
            wanted = model.state_dict()
            if all(k in weights and weights[k].shape == v.shape for k, v in wanted.items()):
                model.load_state_dict({k: weights[k] for k in wanted})
                return model.eval()
    return None


def _gradient_finding(stored: StoredRound, models: _Models, mode: str) -> Finding:
    features = released_class_features(stored.state)
    classes = len(stored.state.extra["prototypes"])
    released = sorted(features)
    if stored.guard is not None:
        at_least = int(stored.guard["k_min"])
        holders = (
            f"the tail guard (k_min {at_least}) released only classes at least {at_least} silos held "
            f"and zeroed {stored.guard['zeroed']}"
        )
    elif len(stored.contributors) == 1:
        at_least, holders = 1, f"one silo contributed ({stored.contributors[0]})"
    else:
        at_least = 1
        holders = (
            "no tail guard: the store does not record how many silos held each class, so any released "
            "class may be one silo's mean feature"
        )
    images, decoded = {}, ""
    if released:
        decoder = models.decoder(stored.round)
        if decoder is None:
            decoded = f"; no images: {models.why_not(stored.round)}"
        else:
            z = torch.stack([features[c] for c in released]).float()
            model = models.received(stored.round)
            drawn = invert_features(model, z, public=models.public, init=decode(decoder, z))
            images = {"recovered": drawn}
            decoded = f"; images drawn in class order through the encoder of round {stored.round - 1}"
    return Finding(
        "analytic",
        mode,
        PARTY,
        f"round {stored.round}: stored per-class head gradients (RedGrape prototypes)",
        {
            "classes": float(classes),
            "classes_released": float(len(released)),
            "classes_withheld": float(classes - len(released)),
            "contributors": float(len(stored.contributors)),
            "holders_at_least": float(at_least),
        },
        bool(released) and at_least < 2,
        True,
        images,
        f"a feature recovered for classes {released}; {holders}{decoded}",
    )


def _presence_finding(
    round_id: str,
    disclosed: dict[str, np.ndarray],
    models: _Models,
    mode: str,
    thresholds: Thresholds,
    holdings: Mapping[str, Collection[int]] | None,
) -> Finding:
    number = next((n for n, s in models.data.rounds.items() if s.round_id == round_id), None)
    model = None if number is None else models.received(number)
    target = f"{round_id}: MFSC class means of {len(disclosed)} silos, which silo holds which class"
    metrics = {"silos": float(len(disclosed))}
    if model is None:
        why = "its round is not among the stored states" if number is None else models.why_not(number)
        # missing is not zero: per-silo class means sit in the store, and scored they gave presence AUC 1.0
        # on the default audit; unscored, the audit must not pass them
        note = f"stored, not scored ({why}); counted as a leak until scored with --public-data"
        return Finding("presence", mode, PARTY, target, metrics, True, True, note=note)
    shape = (model.num_classes, model.feature_dim)
    means = {silo: torch.from_numpy(values.reshape(shape)) for silo, values in disclosed.items()}
    public_x, public_y = torch.from_numpy(models.public.x), torch.from_numpy(models.public.y)
    scores = presence_scores(means, model, public_x, public_y)
    split = {}
    for detector, calls_real in CALLS_REAL.items():
        calls = calls_real(scores[detector])
        split[detector] = int((calls.any(axis=0) & ~calls.all(axis=0)).sum())
        metrics[f"{detector}_called_real"] = float(calls.mean())
        metrics[f"{detector}_classes_split"] = float(split[detector])
    if holdings is None:
        leaked = any(split.values())
        note = (
            "ground truth is unknown to the operator (only the silos know what they hold), so the calls are "
            "not scored; flagged when a detector tells silos apart within a class. The norm and clustering "
            "detectors assume the default selection.min_samples and separation: the store keeps no plan"
        )
    else:
        truth = _truth(holdings, sorted(disclosed), model.num_classes)
        report = presence_report(scores, truth, class_frequency=truth.sum(axis=0), tail_below=0)
        within = {d: r["within_class_auc"] for d, r in report.items()}
        best = max(within, key=lambda d: -1.0 if math.isnan(within[d]) else within[d])
        metrics.update({f"{d}_within_class_auc": auc for d, auc in within.items()})
        metrics["best_detector_within_class_auc"] = within[best]
        leaked = not math.isnan(within[best]) and within[best] > thresholds.presence_auc
        note = f"scored against the holdings the operator gave; best detector: {best}"
    return Finding("presence", mode, PARTY, target, metrics, leaked, True, note=note)


def _census_finding(censuses: Mapping[str, tuple[tuple[str, ...], list[int]]], mode: str) -> Finding:
    """(g) presence intersection on the censuses the store keeps, one per phase: the bits of which silo
    holds which class that all of them pin together beyond what each pins alone by its own counts (a class
    none or all of its silos hold). The release gate keeps a silo from releasing its presence to a second
    set of silos, so a store of a consortium of real silos holds censuses over one set, or sets that add
    nothing."""
    silos = sorted({silo for members, _ in censuses.values() for silo in members})
    classes = max(len(counts) for _, counts in censuses.values())
    target = (
        f"which of {len(silos)} silos holds which of {classes} classes, from the "
        f"{_count(len(censuses), 'census')} the store keeps ({', '.join(censuses)})"
    )
    sets = sorted({members for members, _ in censuses.values()})
    metrics = {"censuses": float(len(censuses)), "silo_sets": float(len(sets))}
    if len(silos) > MAX_SILOS:
        # not enumerable: two censuses over sets that share silos without being equal may pin bits, and are
        # flagged; equal or disjoint sets add nothing to each other's counts
        leaked = any(a != b and set(a) & set(b) for a, b in itertools.combinations(sets, 2))
        note = f"{len(silos)} silos, more than the {MAX_SILOS} an exhaustive reading enumerates" + (
            "; censuses over overlapping but different sets of silos"
            if leaked
            else "; every two censuses over the same or disjoint sets of silos: nothing beyond"
        )
        return Finding(
            "protocol: presence intersection", mode, PARTY, target, metrics, leaked, True, note=note
        )
    index = {silo: k for k, silo in enumerate(silos)}
    per_class = [
        [
            (tuple(index[s] for s in members), counts[c])
            for members, counts in censuses.values()
            if c < len(counts)
        ]
        for c in range(classes)
    ]
    together, alone = pinned_beyond_each(per_class, len(silos))
    bits = len(silos) * classes
    metrics |= {
        "bits_recovered": together / bits,
        "bits_from_census_counts": alone / bits,
        "bits_beyond_census": (together - alone) / bits,
    }
    note = (
        "the censuses together pin presence bits no single census's counts imply"
        if together > alone
        else "the only bits known are those each census's own counts imply (a class none or all hold)"
    )
    return Finding(
        "protocol: presence intersection", mode, PARTY, target, metrics, together > alone, True, note=note
    )


def _truth(holdings: Mapping[str, Collection[int]], silos: list[str], classes: int) -> np.ndarray:
    """[silos, classes]: which disclosed rows are real means, from the operator's `holdings`."""
    missing = sorted(set(silos) - set(holdings))
    if missing:
        raise AggregatorDataError(f"holdings name no classes for the disclosing silos {missing}")
    truth = np.zeros((len(silos), classes), dtype=bool)
    for row, silo in enumerate(silos):
        held = list(holdings[silo])
        if any(not 0 <= c < classes for c in held):
            raise AggregatorDataError(f"holdings of {silo}: classes must lie in [0, {classes}), got {held}")
        truth[row, held] = True
    return truth
