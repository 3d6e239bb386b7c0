"""The federation an audit attacks, the model it faces, and what each party sees of one round in each mode.

Nothing here imitates a protocol: the uploads are the methods' own `local_round` on each silo's data, and
the released sums are the privacy layers' own `aggregate` (the secure sum with its tail guard, CKKS, the
silos' DP noise), so the audit attacks exactly what the code would send.

The federation is the configured long-tailed split with three small classes planted, because a class that a
single record or two represent is where the analysis of `../shared/research/privacy.md` §4a/§4d says
per-class statistics give records away: the rarest class is held by one silo with exactly one record, the
second rarest by one silo with exactly two, and the next class that two silos hold by two silos with one
record each (every other copy moves to the public split). The last one passes a tail guard that counts
silos (k_min = 2) and meets the record floor. The model is FedAvg trained for a few rounds in plaintext (the
attacks need a trained encoder, not a private one); the attacked round runs every method from that model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from attacks.config import AuditConfig, Mode
from fedlt.aggregation import SumLayer, record, tail_guard
from fedlt.aggregation.halves import AggregatorHalf, AggregatorSide, SiloSide, SumSpec
from fedlt.aggregation.sums import Contribution, Sums
from fedlt.config import as_table
from fedlt.data.arrays import LabeledData
from fedlt.data.federation import Federation, build_federation
from fedlt.dp import silo_privacy
from fedlt.errors import FedltError
from fedlt.methods import GlobalState, Method, SiloContext
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import make_method, run_simulation
from privacy.ring import FixedPointCodec
from privacy.secagg.halves import codec_of

# records kept of each planted class at each of its holders: the rarest and second rarest at one silo, then
# a class that two silos hold with one record each
PLANTED = ((1,), (2,), (1, 1))


@dataclass(frozen=True)
class Planted:
    """A small class: `records[k]` of its images at silo `silos[k]`, and nowhere else."""

    label: int
    silos: tuple[int, ...]
    records: tuple[np.ndarray, ...]  # indices into each holder's data

    def describe(self) -> str:
        held = [f"{len(r)} record(s) at silo-{s}" for s, r in zip(self.silos, self.records, strict=True)]
        return f"class {self.label}: {' and '.join(held)}"


@dataclass
class Scenario:
    config: AuditConfig
    federation: Federation  # the silos as attacked, with the planted classes
    public: LabeledData  # the attacker's own data: the held-out split, never trained on
    state: GlobalState  # FedAvg's model after training
    planted: tuple[Planted, ...]

    @property
    def silo_ids(self) -> list[str]:
        return [f"silo-{k}" for k in range(len(self.federation.silos))]


def build_scenario(config: AuditConfig, *, echo=print) -> Scenario:
    """Plant the small classes, then train on exactly those silos: the public split stays unseen."""
    federation = build_federation(config.data, seed=config.seed)
    silos, public, planted = _plant(federation)
    federation = replace(federation, silos=silos)
    echo(f"training the model the attacks face: FedAvg, {config.training.rounds} rounds")
    state = _trained(config, federation, epsilon=0.0)
    return Scenario(config=config, federation=federation, public=public, state=state, planted=planted)


def trained_state(scenario: Scenario, epsilon: float) -> GlobalState:
    """FedAvg trained on the scenario's silos as the grid trains, under [dp] at `epsilon` (the model a
    membership attack faces in a DP mode)."""
    return _trained(scenario.config, scenario.federation, epsilon=epsilon)


def _trained(config: AuditConfig, federation: Federation, *, epsilon: float) -> GlobalState:
    sim = _sim_config(config, "fedavg", epsilon=epsilon)
    with tempfile.TemporaryDirectory(prefix="fedlt-audit-") as folder:
        return run_simulation(sim, Path(folder), echo=lambda _: None, federation=federation).state


# what a consortium must set for a method to run under [dp] (the method refuses its defaults there)
UNDER_DP: dict[str, dict[str, float]] = {"sfd": {"scl_weight": 0.0}}


def _sim_config(config: AuditConfig, method: str, *, epsilon: float):
    tables = {
        "data": as_table(config.data),
        "train": {k: getattr(config.training, k) for k in ("local_epochs", "lr", "momentum")},
    }
    if epsilon > 0:
        tables["dp"] = {"enabled": True, "epsilon": epsilon}
    return load_sim_config(
        None,
        {"seed": config.seed, "rounds": config.training.rounds},
        method={"name": method, **(UNDER_DP.get(method, {}) if epsilon > 0 else {})},
        tables=tables,
    )


def _plant(federation: Federation) -> tuple[list[LabeledData], LabeledData, tuple[Planted, ...]]:
    """Keep `PLANTED` records of the rarest classes at the silos holding most of each (a class planted at
    two silos: the rarest class left that two silos hold); every other image of those classes joins the
    public split (so the attacker's data stays disjoint from the silos')."""
    silos = list(federation.silos)
    public = [federation.test]
    planted, taken = [], set()
    for keep in PLANTED:
        label, holders = _rarest_held(federation, silos, keep, taken)
        taken.add(label)
        for k, silo in enumerate(silos):
            rows = np.flatnonzero(silo.y == label)
            leave = rows[keep[holders.index(k)] :] if k in holders else rows
            public.append(silo.subset(leave))
            silos[k] = silo.subset(np.setdiff1d(np.arange(len(silo)), leave))
        planted.append((label, holders))
    found = []
    for label, holders in planted:  # indices once every planted class has left its other rows
        records = tuple(np.flatnonzero(silos[h].y == label) for h in holders)
        found.append(Planted(label, holders, records))
    return silos, joined(public), tuple(found)


def _rarest_held(
    federation: Federation, silos: list[LabeledData], keep: tuple[int, ...], taken: set[int]
) -> tuple[int, tuple[int, ...]]:
    """The rarest class not yet planted whose largest holders have `keep` records to give (as many holders
    as `keep` names), and those holders."""
    for label in (int(c) for c in np.argsort(federation.train_counts, kind="stable")):
        held = np.array([int((s.y == label).sum()) for s in silos])
        largest = np.argsort(-held, kind="stable")[: len(keep)]  # PLANTED keeps as much at each holder
        if label not in taken and (held[largest] >= max(keep)).all():
            return label, tuple(int(k) for k in largest)
    raise ValueError(
        f"no class left whose largest holders have {list(keep)} records: raise data.silos or lower "
        "data.imbalance"
    )


def joined(parts: list[LabeledData]) -> LabeledData:
    return LabeledData(
        np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]), parts[0].classes
    )


@dataclass
class Uploads:
    """One round of one method from the trained model: each silo's upload (and, under DP, its noise side)."""

    method: Method
    state: GlobalState  # the state the silos received
    contributions: list[Contribution]  # what the aggregator sees in plaintext
    private: dict  # silo id -> its DP side, empty without DP


def silo_uploads(scenario: Scenario, method_name: str, epsilon: float) -> Uploads:
    """What every silo sends in one round of `method_name`, under [dp] at `epsilon` if it is > 0 (the
    uploads do not depend on the sum layer, only on DP)."""
    method = method_for(scenario, method_name, epsilon)
    state = attacked_state(method, scenario.state)
    ids = scenario.silo_ids
    dp = method.dp
    private = {i: silo_privacy(dp, method=method, ledger=None) for i in ids} if dp is not None else {}
    contributions = [
        method.local_round(state, data, SiloContext(state.round + 1, i, scenario.config.seed, private.get(i)))
        for i, data in zip(ids, scenario.federation.silos, strict=True)
    ]
    return Uploads(method, state, contributions, private)


def method_for(scenario: Scenario, name: str, epsilon: float = 0.0) -> Method:
    sim = _sim_config(scenario.config, name, epsilon=epsilon)
    return make_method(sim, scenario.public.input_shape, len(scenario.public.classes))


class Refused(FedltError):
    """Every silo would refuse the round under its policy: nothing of it is released."""


@dataclass(frozen=True)
class Release:
    """What a mode's round gives away: `sums`, read by the aggregator (secagg, plaintext) or by every silo
    (ckks, blind); the classes its tail guard zeroed in every per-class field and, by the record floor, in
    the fields that invert (each silo zeroed them in its own upload too); and, where the aggregator holds a
    ring total it cannot unmask (blind: the sum under every silo's output mask), that total's bytes and the
    sum's codec, for the attacks to read it as the aggregator would (`total`, `codec`)."""

    sums: Sums
    zeroed: tuple[int, ...] = ()
    floored: tuple[int, ...] = ()
    total: bytes | None = field(default=None, repr=False)
    codec: FixedPointCodec | None = None


def released(scenario: Scenario, uploads: Uploads, mode: Mode, *, keep_total: bool = False) -> Release:
    """The sums `mode`'s layer releases from these uploads: to the aggregator (secagg), to every silo (CKKS,
    blind), or everything to the aggregator (plaintext, which also sees each upload); with `keep_total`, also
    the ring total the aggregator's half handed the silos (blind). `Refused` where silos with the mode's
    policy would not take part (statistics that invert, without DP and without a floor)."""
    kept: dict[str, AggregatorHalf] = {}
    keeping, settings = _keeping(record(mode.privacy).layer, kept), _layer_settings(mode)
    layer = keeping() if settings is None else keeping(settings)
    schema = uploads.method.schema(uploads.state)
    if mode.privacy != "plaintext":
        refusal = tail_guard.inverting_problems(
            schema, mode.min_records, dp=uploads.method.dp is not None, accepted=mode.min_records
        )
        if refusal:
            raise Refused(refusal[0])
    noise = uploads.private or None
    records = {
        i: np.bincount(silo.y, minlength=silo.num_classes)
        for i, silo in zip(scenario.silo_ids, scenario.federation.silos, strict=True)
    }
    sums = layer.aggregate(
        schema, uploads.contributions, silos=scenario.silo_ids, noise=noise, records=records
    )
    guarded = {"zeroed": tuple(layer.zeroed), "floored": tuple(layer.floored)}
    if not keep_total:
        return Release(sums, **guarded)
    half = kept["contribution"]
    total = half.download(scenario.silo_ids[0])  # every silo of this round was handed the same total
    return Release(sums, **guarded, total=total, codec=codec_of(half.spec))


class _Keeping(AggregatorSide):
    """An aggregator side that keeps the last half it made for each purpose, to read afterwards what the
    aggregator held."""

    def __init__(self, side: AggregatorSide, kept: dict[str, AggregatorHalf]) -> None:
        self.side, self.kept = side, kept

    def half(self, spec: SumSpec) -> AggregatorHalf:
        self.kept[spec.purpose] = self.side.half(spec)
        return self.kept[spec.purpose]


def _keeping(cls: type[SumLayer], kept: dict[str, AggregatorHalf]) -> type[SumLayer]:
    """The layer `cls` whose in-process aggregator side keeps its halves in `kept`."""

    class Keeping(cls):
        def in_process(self, silos: Sequence[str]) -> tuple[Mapping[str, SiloSide], AggregatorSide]:
            sides, aggregator = super().in_process(silos)
            return sides, _Keeping(aggregator, kept)

    return Keeping


def attacked_state(method: Method, trained: GlobalState) -> GlobalState:
    """The method's state for the round it sends its statistics in, over the trained backbone: its own fresh
    extras (CReFF's head and features) and extra layers (SFD's projector) on FedAvg's model, a post-hoc
    method at its closing round."""
    fresh = method.init_state(seed=0)
    extra = dict(fresh.extra)
    if "trained" in extra:
        extra["trained"] = torch.tensor(method.rounds)
    model = {k: trained.model.get(k, v).clone() for k, v in fresh.model.items()}  # SFD adds a projector
    return GlobalState(method.rounds, model, extra)


def _layer_settings(mode: Mode):
    """The layer's own settings section with the mode's tail guard (its record in the registry)."""
    section = record(mode.privacy).settings
    return None if section is None else section(k_min=mode.k_min, min_records=mode.min_records)
