"""`silo.toml`: how to reach the aggregator, which data to train on, and what this silo agrees to.

A silo that takes part in several studies of one aggregator names each in a `[study.<id>]` table, with its own
`data`, `evaluation`, `policy` and `monitoring` where the study needs them; everything else (the connection,
the certificate, the [dp] budget, the state directory and its ledgers) is the silo's one, across its studies.
`SiloConfig.for_study` is the config a study's agent runs with. Without any `[study.*]` table the agent takes
part in the aggregator's default study, exactly as before studies existed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from fedlt.aggregation import layer_names
from fedlt.aggregation.registry import DEFAULT_LAYER
from fedlt.aggregation.tail_guard import ONLY_UNDER_DP
from fedlt.config import parse_section, read_toml, resolve, setting
from fedlt.data.federation import DataConfig, Federation, build_federation
from fedlt.data.source import FORMATS, DataSource, Slice, embedded, open_source
from fedlt.device import DEVICE_FORM, device_checked
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.keepalive import MIN_SECONDS
from fedlt.listen import is_loopback, split_listen
from fedlt.methods import METHODS
from fedlt.models.entry import ENTRY_FORM, parse_entry
from fedlt.studies import id_problems

STUDY_FOLDERS = "studies"  # in state_dir: one folder per study, `studies/<id>/`


@dataclass(frozen=True)
class ConnectionSection:
    aggregator: str = setting("127.0.0.1:50051", doc="host:port of the aggregator")
    server_name: str = setting("", doc="name in the aggregator's certificate, if not the host above")
    ca: str = "pki/ca.pem"
    certificate: str = "pki/silo.pem"
    key: str = "pki/silo.key"
    roster: str = setting(
        "pki/roster.json",
        doc="the roster from the enrollment kit; pinned on first start, then changed only "
        "by a roster a quorum of its silos signed",
    )
    crl: str = setting(
        "", doc="a CRL file this silo keeps up to date itself, besides the one the aggregator relays"
    )
    heartbeat_seconds: float = setting(10.0, gt=0.0)
    keepalive_seconds: float = setting(
        30.0, ge=MIN_SECONDS, doc="ping the aggregator after this much silence; drop a link silent as long"
    )
    max_backoff_seconds: float = setting(30.0, gt=0.0)
    renew_within_days: int = setting(
        30, ge=0, doc="warn when this silo's certificate or the consortium CA's expires sooner"
    )


@dataclass(frozen=True)
class DataSection:
    """Either this silo's own files, or (demos, tests) shard `index` of an embedded long-tail recipe."""

    source: str = setting("files", choices=("files", "embedded"))
    path: str = ""
    format: str = setting("", choices=("", *FORMATS), doc="empty: inferred from the path")
    labels: str = setting("", doc="labels file: the idx format's, or a dicom folder's CSV of file,label")
    index: int = setting(0, ge=0, doc="embedded: which silo of the recipe this is")
    seed: int = setting(0, ge=0, doc="embedded: the recipe's seed")
    recipe: DataConfig = field(default_factory=DataConfig)


@dataclass(frozen=True)
class PolicySection:
    """What this silo agrees to; a RoundSpec asking for anything else is refused, not negotiated."""

    methods: tuple[str, ...] = tuple(METHODS)
    privacy: tuple[str, ...] = (DEFAULT_LAYER,)
    disclosures: tuple[str, ...] = ()
    max_state_mb: float = setting(2048.0, gt=0.0)
    max_data_mb: float = setting(
        0.0,
        ge=0.0,
        doc="refuse a plan making this silo's data bigger (samples x input x 4 bytes); 0: half the RAM",
    )
    min_tail_guard: int = setting(2, ge=0, doc="refuse rounds whose tail guard k_min is lower")
    min_class_records: int = setting(
        ONLY_UNDER_DP,
        ge=0,
        doc="release per-class statistics that invert (second moments, per-class gradients) without [dp] "
        "only under a record floor this high; 0: only under [dp] (they give records back at any class size)",
    )
    min_participants: int = setting(3, ge=2, doc="refuse secure sums over fewer silos")
    min_survivors: int = setting(
        3, ge=2, doc="release nothing into a sum that counts fewer silos, once dropouts are known"
    )
    threshold_above: str = setting(
        "2/3", doc="refuse secure sums whose threshold is not above this fraction of a seed's holders"
    )
    disclosure_min_samples: int = setting(
        5, ge=1, doc="mfsc: disclose a class's mean only if this silo holds at least this many samples of it"
    )
    min_neighbours: int = setting(
        0,
        ge=0,
        doc="accept SecAgg+ graphs with at least this many neighbours per silo; 0: complete graph only",
    )
    roster_quorum_above: str = setting(
        "1/2",
        doc="refuse a roster whose quorum of silo signatures is not above this fraction of its silos",
    )
    models: tuple[dict, ...] = setting(
        (),
        doc='entry points a plan may name as its model, each pinned: [{ entry = "package.module:factory", '
        'sha256 = "..." }] as `python -m silo models pin` prints it; built-in models need no pin',
    )

    def data_limit(self) -> float:
        """Bytes of prepared data a plan may ask of this silo: `max_data_mb`, or half the machine's memory."""
        if self.max_data_mb:
            return self.max_data_mb * 2**20
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2

    @property
    def pinned_models(self) -> dict[str, str]:
        """Each allowed entry point's pinned digest (`silo.models`), once `problems` found none."""
        return {pin["entry"]: pin["sha256"] for pin in self.models}

    def problems(self) -> list[str]:
        found = _pin_problems(self.models)
        unknown_methods = sorted(set(self.methods) - set(METHODS))
        if unknown_methods:
            found.append(f"policy.methods: unknown {unknown_methods}; known: {', '.join(METHODS)}")
        unknown_layers = sorted(set(self.privacy) - set(layer_names()))
        if unknown_layers:
            found.append(
                f"policy.privacy: {unknown_layers} not installed with this agent; "
                f"installed: {', '.join(layer_names())}"
            )
        fraction = _fraction(self.threshold_above)
        if fraction is None or not Fraction(1, 2) <= fraction < 1:
            found.append(
                f"policy.threshold_above: a fraction from 1/2 up to (not including) 1, such as '2/3'; "
                f"got {self.threshold_above!r}"
            )
        quorum = _fraction(self.roster_quorum_above)
        if quorum is None or not 0 <= quorum < 1:
            found.append(
                f"policy.roster_quorum_above: a fraction from 0 up to (not including) 1, such as '1/2'; "
                f"got {self.roster_quorum_above!r}"
            )
        if self.min_survivors > self.min_participants:
            found.append(
                f"policy.min_survivors: {self.min_survivors} is more than policy.min_participants "
                f"{self.min_participants}, so no sum could ever count enough silos"
            )
        return found


def _pin_problems(pins: tuple[dict, ...]) -> list[str]:
    """Each `[policy] models` item: exactly an entry point and a SHA-256 in hex, each entry point once."""
    found, seen = [], set()
    for k, pin in enumerate(pins):
        where = f"policy.models[{k}]"
        if set(pin) != {"entry", "sha256"}:
            form = '{ entry = "package.module:factory", sha256 = "..." }'
            found.append(f"{where}: expected {form}, got {pin}")
            continue
        entry, digest = pin["entry"], pin["sha256"]
        if not isinstance(entry, str) or parse_entry(entry) is None:
            found.append(f"{where}.entry: {entry!r} is not an entry point {ENTRY_FORM}")
        elif entry in seen:
            found.append(f"{where}.entry: {entry!r} is listed twice")
        else:
            seen.add(entry)
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            found.append(
                f"{where}.sha256: expected 64 lowercase hex digits as `python -m silo models pin` prints, "
                f"got {digest!r}"
            )
    return found


def _fraction(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


@dataclass(frozen=True)
class EvaluationSection:
    """Held-out data this silo evaluates each state on, in the plan's label space like [data]; only counts
    leave, and only inside a sum. Every `parts`-th sample from `part`, so silos sharing one test set split
    it."""

    path: str = setting("", doc="held-out files, as in [data]; empty: the embedded recipe's test split")
    format: str = setting("", choices=("", *FORMATS))
    labels: str = ""
    part: int = setting(0, ge=0)
    parts: int = setting(1, ge=1)


@dataclass(frozen=True)
class DPSection:
    """This silo's differential-privacy budget for its records, kept in its ledger across runs and restarts.

    A plan's `[dp]` settings (noise, clipping, rounds) are the aggregator's word; the ledger is the silo's:
    whatever a plan says, work that would take the silo past this budget is refused."""

    epsilon: float = setting(8.0, gt=0.0, doc="the most ε this silo ever spends on its records")
    delta: float = setting(1e-5, gt=0.0, le=0.1, doc="δ of the budget; keep it below 1 / (records)")
    require: bool = setting(False, doc="refuse every round whose plan does not enable [dp]")
    report: bool = setting(False, doc="tell the aggregator the remaining ε (operators see it in status)")

    def problems(self, plan: DPSettings) -> list[str]:
        """What in a plan's [dp] this silo refuses before any work (its ledger guards the rest)."""
        if self.require and not plan.enabled:
            return ["its plan does not enable [dp], which this silo's dp.require asks for"]
        return []


@dataclass(frozen=True)
class ComputeSection:
    """This silo's hardware, its own choice whatever plan it joins (`fedlt.device`)."""

    threads: int = setting(0, ge=0, doc="CPU threads for training; 0 uses every core")
    device: str = setting(
        "auto",
        doc=f"{DEVICE_FORM}: where this silo trains, computes its statistics and evaluates; auto is a GPU "
        "where torch sees one. Server steps this silo runs stay on the CPU, where every silo agrees",
    )

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str, problems: list[str]) -> ComputeSection:
        """`device` checked for its form here; whether this machine has it, when the agent starts."""
        return parse_section(cls, device_checked(table, where, problems), where, problems)


@dataclass(frozen=True)
class MonitoringSection:
    """This silo's own Prometheus endpoint (`fedlt.telemetry.prometheus.SiloMetrics`), off by default: only
    what the silo itself knows (the rounds it took part in, its refusals by code, the ε its ledger spent,
    its last contact with the aggregator). It has no authentication, so it listens on loopback unless its
    administrator says otherwise."""

    prometheus: str = setting(
        "", doc="host:port to serve /metrics on, e.g. 127.0.0.1:9465 (empty: none; port 0 lets the OS choose)"
    )
    prometheus_remote: bool = setting(
        False,
        doc="allow an address other than loopback: whoever reaches it reads the metrics, so only on a "
        "network this silo's administrator controls",
    )

    def problems(self) -> list[str]:
        if not self.prometheus:
            return []
        try:
            host, _ = split_listen(self.prometheus)
        except ValueError as exc:
            return [f"monitoring.prometheus: {exc}, such as '127.0.0.1:9465'"]
        if not is_loopback(host) and not self.prometheus_remote:
            return [
                f"monitoring.prometheus: {host} is not a loopback address and the endpoint has no "
                "authentication: listen on 127.0.0.1 (and scrape through an SSH tunnel), or set "
                "monitoring.prometheus_remote = true on a network this silo's administrator controls"
            ]
        return []


@dataclass(frozen=True)
class Study:
    """One study this silo takes part in, as `[study.<id>]` and the top-level sections make it."""

    id: str
    data: DataSection
    evaluation: EvaluationSection
    policy: PolicySection
    monitoring: MonitoringSection


@dataclass(frozen=True)
class SiloConfig:
    connection: ConnectionSection = field(default_factory=ConnectionSection)
    data: DataSection = field(default_factory=DataSection)
    policy: PolicySection = field(default_factory=PolicySection)
    compute: ComputeSection = field(default_factory=ComputeSection)
    dp: DPSection = field(default_factory=DPSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    monitoring: MonitoringSection = field(default_factory=MonitoringSection)
    state_dir: str = setting(
        "silo-state",
        doc="the silo's ledgers, pinned roster, progress and pending uploads survive restarts here (each "
        "study's own in studies/<id>/)",
    )
    base_dir: Path = Path()
    # not silo.toml keys: the [study.<id>] tables (`load_silo_config`), and what `for_study` sets
    studies: tuple[Study, ...] = ()
    study: str = ""  # the study this config's agent takes part in; "" the aggregator's default study
    shared_state_dir: str = ""  # state_dir of the whole silo, where `state_dir` is one study's folder

    def path(self, value: str) -> Path:
        """`value` relative to silo.toml's folder, normalised (`a/../b` as `b`): messages name it plainly."""
        return Path(os.path.normpath(resolve(self.base_dir, value)))

    def shared_dir(self) -> Path:
        """What the silo keeps across its studies: both ledgers, the pinned roster and revocations, the mask
        secret. The same folder as `state_dir` for a silo without studies."""
        return self.path(self.shared_state_dir or self.state_dir)

    @property
    def study_ids(self) -> tuple[str, ...]:
        return tuple(study.id for study in self.studies)

    def for_study(self, study: str) -> SiloConfig:
        """The config study `study`'s agent runs with: its sections where its table gives them, and its own
        folder, `studies/<id>/` of state_dir, for its progress, pending upload, keys and lock (`shared_dir`
        stays the silo's). ConfigError if silo.toml names no such study."""
        found = next((s for s in self.studies if s.id == study), None)
        if found is None:
            known = ", ".join(self.study_ids) or "none: silo.toml has no [study.<id>] table"
            raise ConfigError("--study", [f"silo.toml names no study {study!r}; its studies: {known}"])
        return replace(
            self,
            data=found.data,
            evaluation=found.evaluation,
            policy=found.policy,
            monitoring=found.monitoring,
            study=study,
            state_dir=str(Path(self.state_dir, STUDY_FOLDERS, study)),
            shared_state_dir=self.state_dir,
        )

    def load_data(self) -> DataSource:
        """This silo's files, opened (each plan prepares them its own way at admission)."""
        data = self.data
        if data.source == "embedded":
            federation = _federation(data.recipe, data.seed)
            return embedded(federation.silos[data.index], federation.table)
        return self._files(data.path, data.format, data.labels)

    def load_evaluation(self) -> DataSource | None:
        """The held-out slice to evaluate on; None when there is none (then only zero counts go out)."""
        section = self.evaluation
        if section.path:
            held_out = self._files(section.path, section.format, section.labels)
        elif self.data.source == "embedded":
            federation = _federation(self.data.recipe, self.data.seed)
            held_out = embedded(federation.test, federation.table)
        else:
            return None
        return Slice(held_out, section.part, section.parts)

    def _files(self, path: str, format: str, labels: str) -> DataSource:
        options = {"labels": str(self.path(labels))} if labels else {}
        return open_source(self.path(path), format=format or None, **options)


@functools.cache
def _federation(recipe: DataConfig, seed: int) -> Federation:
    """An embedded recipe's shards and test split, built once for the training data and the held-out slice."""
    return build_federation(recipe, seed=seed)


def load_silo_config(path: str | Path) -> SiloConfig:
    path = Path(path)
    tree = read_toml(path)
    problems: list[str] = []
    tree.pop("base_dir", None)
    tables = tree.pop("study", None)
    for key in ("studies", "shared_state_dir"):
        if tree.pop(key, None) is not None:
            problems.append(f"{key}: unknown setting (studies are [study.<id>] tables)")
    config = parse_section(SiloConfig, tree, "", problems)
    config = replace(config, base_dir=path.parent)
    problems += config.policy.problems()
    if tables is not None:
        config = replace(config, studies=_studies(tables, config, problems))
        problems += _monitoring_problems(config)
    else:
        problems += config.monitoring.problems()
    # [data] and [evaluation] matter where a study takes them (every study may have its own)
    studies = config.studies
    if not studies or any(s.data is config.data for s in studies):
        problems += _data_problems(config.data, "")
    if not studies or any(s.evaluation is config.evaluation for s in studies):
        problems += _evaluation_problems(config.evaluation, "")
    if problems:
        raise ConfigError(path, problems)
    return config


def _data_problems(data: DataSection, where: str) -> list[str]:
    """[data] as a whole (each key's own checks are `parse_section`'s)."""
    found = []
    if data.source == "files" and not data.path:
        found.append(f"{where}data.path: required when data.source = 'files'")
    if data.source == "embedded" and data.index >= data.recipe.silos:
        found.append(f"{where}data.index: {data.index} but the recipe has {data.recipe.silos} silos")
    return found


def _evaluation_problems(evaluation: EvaluationSection, where: str) -> list[str]:
    if evaluation.part >= evaluation.parts:
        return [f"{where}evaluation.part: {evaluation.part} but parts is {evaluation.parts}"]
    return []


@dataclass(frozen=True)
class _StudyTable:
    """The sub-tables a [study.<id>] table may hold, each of the form of the top-level section."""

    data: DataSection | None = None
    evaluation: EvaluationSection | None = None
    policy: PolicySection | None = None
    monitoring: MonitoringSection | None = None


# what is the silo's one, across its studies, and why a study table cannot set it
_SILO_WIDE = {
    "dp": "the silo has one privacy budget and one ledger across its studies: set it in [dp]",
    "connection": "every study is a study of one aggregator, reached the same way: set it in [connection]",
    "compute": "set it in [compute], for every study",
    "state_dir": "every study keeps its own folder, studies/<id>/, in the silo's state_dir",
}
# policy keys that guard what all studies share: the one pinned roster, the one release ledger
_SILO_WIDE_POLICY = {
    "roster_quorum_above": "the pinned roster is the silo's one, across its studies: set it in [policy]",
    "min_class_records": "the census sends this silo's record counts capped at this floor, and two "
    "studies' censuses over the same silos at two floors would give the counts away: set it in [policy], "
    "for every study",
}


def _studies(tables: object, config: SiloConfig, problems: list[str]) -> tuple[Study, ...]:
    """Each [study.<id>] table, its sections resolved against the top-level ones."""
    if not isinstance(tables, Mapping) or not tables:
        problems.append("study: expected one [study.<id>] table per study, such as [study.readmission]")
        return ()
    studies = []
    for study, table in tables.items():
        where = f"study.{study}"
        problems += id_problems(study, where)
        if not isinstance(table, Mapping):
            problems.append(f"{where}: expected a table, such as [{where}.data]")
            continue
        table = dict(table)
        for key, why in _SILO_WIDE.items():
            if table.pop(key, None) is not None:
                problems.append(f"{where}.{key}: not a study's own setting: {why}")
        policy = dict(table.get("policy") or {}) if isinstance(table.get("policy"), Mapping) else None
        for key, why in _SILO_WIDE_POLICY.items():
            if policy is not None and policy.pop(key, None) is not None:
                problems.append(f"{where}.policy.{key}: not a study's own setting: {why}")
        if policy is not None:
            table["policy"] = policy
        own = parse_section(_StudyTable, table, where, problems)
        resolved = Study(
            id=study,
            data=own.data or config.data,
            evaluation=own.evaluation or config.evaluation,
            policy=_study_policy(config.policy, own.policy, policy or {}, where, problems),
            monitoring=own.monitoring or MonitoringSection(),
        )
        if own.data is not None:
            problems += _data_problems(own.data, f"{where}.")
        if own.evaluation is not None:
            problems += _evaluation_problems(own.evaluation, f"{where}.")
        problems += [f"{where}.{p}" for p in resolved.monitoring.problems()]
        studies.append(resolved)
    return tuple(studies)


def _study_policy(
    top: PolicySection, own: PolicySection | None, keys: Mapping[str, Any], where: str, problems: list[str]
) -> PolicySection:
    """[policy] with the keys a study's policy table sets replaced; the problems only the combination has,
    named for the study."""
    if own is None:
        return top
    fields = {f.name for f in dataclasses.fields(PolicySection)}
    merged = replace(top, **{key: getattr(own, key) for key in keys if key in fields})
    known = set(top.problems())
    problems += [f"{where}.{p}" for p in merged.problems() if p not in known]
    return merged


def _monitoring_problems(config: SiloConfig) -> list[str]:
    """With studies, each study's agent is a process of its own: one Prometheus port each."""
    found = []
    if config.monitoring.prometheus:
        found.append(
            "monitoring.prometheus: with [study.<id>] tables each study's agent runs as a process of its "
            "own, and they cannot share one port: set prometheus in each [study.<id>.monitoring] instead, "
            "each on its own port"
        )
    seen: dict[str, str] = {}
    for study in config.studies:
        listen = study.monitoring.prometheus
        if listen and not listen.endswith(":0") and listen in seen:
            where = f"study.{study.id}.monitoring.prometheus"
            found.append(f"{where}: {listen} is study {seen[listen]!r}'s too; give each study its own port")
        seen.setdefault(listen, study.id)
    return found
