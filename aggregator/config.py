"""`consortium.toml`: who the consortium is, where the aggregator listens, and what every round runs."""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from aggregator.catalog import STUDIES, BadStudy
from aggregator.status_page import CONNECTIONS, TOKEN_FILE
from aggregator.store import Retention
from fedlt.aggregation import layer_names, layers, record
from fedlt.aggregation.registry import DEFAULT_LAYER
from fedlt.aggregation.tail_guard import guard_of
from fedlt.config import as_toml, parse_section, read_toml, resolve, setting
from fedlt.data.embedded import EMBEDDED
from fedlt.errors import ConfigError
from fedlt.keepalive import MIN_SECONDS
from fedlt.metrics import ShotThresholds
from fedlt.models.entry import parse_entry
from fedlt.plan import RoundPlan
from fedlt.studies import DEFAULT_STUDY, id_problems
from fedlt.telemetry import TENSORBOARD
from fedlt.telemetry.to_mlflow import DEFAULT_EXPERIMENT
from fedlt.telemetry.to_mlflow import INSTALL as MLFLOW_INSTALL
from fedlt.telemetry.to_mlflow import installed as mlflow_installed


def layer_sections() -> dict[str, type]:
    """Each installed privacy layer's own section of consortium.toml, by layer name (`[<layer>]`)."""
    return {name: layer.settings for name, layer in layers().items() if layer.settings is not None}


@dataclass(frozen=True)
class ConsortiumSection:
    id: str = setting("fedlt-consortium", doc="name silos check in every RoundSpec")
    rounds: int = setting(20, ge=1)
    seed: int = setting(0, ge=0)
    privacy: str = setting(DEFAULT_LAYER, choices=layer_names, doc="plaintext is for research and tests only")
    min_silos: int = setting(
        3, ge=1, doc="a round needs this many contributions, else it is retried (silos refuse sums of two)"
    )
    exit_when_done: bool = setting(True, doc="stop serving once the last round is committed")


@dataclass(frozen=True)
class ServerSection:
    listen: str = setting("127.0.0.1:50051", doc="host:port; port 0 lets the OS choose")
    certificate: str = "pki/aggregator.pem"
    key: str = "pki/aggregator.key"
    ca: str = "pki/ca.pem"
    crl: str = "pki/crl.pem"
    roster: str = setting(
        "pki/roster.json", doc="the consortium's roster; silos adopt a newer one a quorum signed"
    )
    data_dir: str = setting("aggregator-data", doc="SQLite database and the run's metrics and plots")
    renew_within_days: int = setting(
        30, ge=0, doc="warn when a certificate (the aggregator's, the CA's, a roster member's) expires sooner"
    )
    status_page: str = setting(
        "",
        doc="host:port of the read-only status page (empty: none); a loopback host serves HTTP to this "
        "machine with an access token, any other HTTPS to operator certificates only; port 0 lets the OS "
        "choose",
    )
    status_page_token: str = setting(
        "",
        doc=f"file the loopback page's access token is written to (mode 0600) at each start; empty: "
        f"{TOKEN_FILE} in data_dir",
    )
    status_page_connections: int = setting(
        CONNECTIONS, ge=1, le=1024, doc="connections the page serves at once; more are closed when accepted"
    )
    default_study: str = setting(
        DEFAULT_STUDY,
        doc="the id of the study this file's plan defines, the one silos' calls naming no study are for; "
        "empty: none (studies come only from `python -m aggregator study create`)",
    )
    max_studies: int = setting(4, ge=1, doc="studies that run at once; the others wait in a queue")
    study_models: tuple[str, ...] = setting(
        (),
        doc="entry points (package.module:factory) a study created with `python -m aggregator study create` "
        "may name as its model; built-in models need no listing. The aggregator imports and calls a study's "
        "model, so only this file, not an operator's request, decides which code that is",
    )


@dataclass(frozen=True)
class TimeoutSection:
    gather: float = setting(10.0, ge=0.0, doc="after min_silos are connected, wait this long for the rest")
    round: float = setting(600.0, gt=0.0, doc="contributions must arrive within this many seconds")
    stage: float = setting(60.0, gt=0.0, doc="each later secure-aggregation stage waits this long")
    keepalive: float = setting(
        30.0, ge=MIN_SECONDS, doc="ping a silo after this long without traffic; drop a link silent as long"
    )


@dataclass(frozen=True)
class EvaluationSection:
    """How committed states are evaluated: on the silos' own held-out data, inside the round's sum
    (`held_out`), or on an evaluation set the operator holds (`dataset`, never silo data); with neither,
    rounds are not evaluated."""

    held_out: bool | None = setting(
        None,
        doc="silos evaluate each committed state on their held-out data and only the sum of their per-class "
        "counts reaches the operator; default: on where the aggregator steps the model (secagg, plaintext) "
        "and no dataset is named",
    )
    dataset: str = setting("", choices=("", *EMBEDDED), doc="embedded test split to evaluate on")
    test_per_class: int = setting(100, ge=1)
    class_counts: tuple[int, ...] = ()
    background: bool = setting(
        False, doc="evaluate while the next round trains; pays only when the aggregator has its own cores"
    )

    def held_out_for(self, privacy: str) -> bool:
        """`held_out` as set, or its default for the layer."""
        if self.held_out is not None:
            return self.held_out
        return not self.dataset and not record(privacy).silos_step

    def problems(self, privacy: str, classes: int) -> list[str]:
        """Combinations that cannot work, each with the way out."""
        found = []
        if self.class_counts and len(self.class_counts) != classes:
            found.append(f"evaluation.class_counts: {len(self.class_counts)} counts for {classes} classes")
        if not self.held_out_for(privacy):
            return found
        if record(privacy).silos_step:
            found.append(
                f"evaluation.held_out: under {privacy} the silos already evaluate each state on their "
                "[evaluation] data and sum the counts themselves; remove the setting"
            )
        if self.dataset:
            found.append(
                "evaluation.held_out: the silos' held-out data and evaluation.dataset would be two "
                "evaluations of each state; set held_out = false or remove the dataset"
            )
        if self.class_counts:
            found.append(
                "evaluation.class_counts: with held-out evaluation the shot groups come from the silos' "
                "summed training records (round 1); remove class_counts"
            )
        return found


@dataclass(frozen=True)
class MonitoringSection:
    """Where each recorded round's metrics go besides run/metrics.json (`fedlt.telemetry`); the Prometheus
    endpoint is the status page's `/metrics`, under the page's credentials ([server] status_page)."""

    tensorboard: bool = setting(True, doc=f"write TensorBoard event files to data_dir/{TENSORBOARD}")
    mlflow_uri: str = setting(
        "",
        doc=f"an MLflow tracking server to log rounds to, e.g. http://127.0.0.1:5000 (empty: none; needs "
        f"{MLFLOW_INSTALL}); a server that fails is logged and never stops a round",
    )
    mlflow_experiment: str = setting(DEFAULT_EXPERIMENT, doc="the MLflow experiment the run is logged under")
    mlflow_run: str = setting("", doc="the MLflow run's name; empty: the consortium id")

    def problems(self) -> list[str]:
        if self.mlflow_uri and not mlflow_installed():
            return [f"monitoring.mlflow_uri: the mlflow package is not installed here: {MLFLOW_INSTALL}"]
        if self.mlflow_uri and not self.mlflow_experiment:
            return ["monitoring.mlflow_experiment: name the MLflow experiment the run is logged under"]
        return []


@dataclass(frozen=True)
class ConsortiumConfig:
    consortium: ConsortiumSection = field(default_factory=ConsortiumSection)
    server: ServerSection = field(default_factory=ServerSection)
    timeouts: TimeoutSection = field(default_factory=TimeoutSection)
    plan: RoundPlan = field(default_factory=RoundPlan)
    # each installed layer's section, by layer name (the defaults of those a file leaves out)
    layers: Mapping[str, object] = field(
        default_factory=lambda: {n: s() for n, s in layer_sections().items()}
    )
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    metrics: ShotThresholds = field(default_factory=ShotThresholds)
    retention: Retention = field(default_factory=Retention)
    monitoring: MonitoringSection = field(default_factory=MonitoringSection)
    base_dir: Path = Path()

    def __post_init__(self) -> None:
        # one source of truth for the number of training rounds: the plan silos receive takes it from here
        if self.plan.rounds != self.consortium.rounds:
            object.__setattr__(self, "plan", replace(self.plan, rounds=self.consortium.rounds))
        # and for held-out evaluation, which silos read from the signed plan (a file's default is resolved
        # when it is loaded; built in code, a config evaluates on held-out data only if asked)
        held_out = bool(self.evaluation.held_out)
        if self.plan.evaluation.held_out != held_out:
            evaluation = replace(self.plan.evaluation, held_out=held_out)
            object.__setattr__(self, "plan", replace(self.plan, evaluation=evaluation))

    def path(self, value: str) -> Path:
        return resolve(self.base_dir, value)

    @property
    def silos_evaluate(self) -> bool:
        """Whether the run's metrics are the silos' summed counts on their own held-out data: held-out
        evaluation, or a layer under which silos step the model and sum their counts themselves."""
        return self.plan.evaluation.held_out or record(self.consortium.privacy).silos_step

    def layer_settings(self) -> object | None:
        """The chosen privacy layer's own section (None for a layer without settings)."""
        settings = record(self.consortium.privacy).settings
        if settings is None:
            return None
        return self.layers.get(self.consortium.privacy) or settings()

    def fingerprint(self) -> str:
        """The settings a data directory is bound to; `rounds` may grow, listening details may change. Of
        the layers, only the chosen one's section counts: installing another layer changes no run."""
        same_run = replace(self.consortium, rounds=1, exit_when_done=True)
        plan = replace(self.plan, rounds=1)
        chosen = self.layer_settings()
        layer = "" if chosen is None else as_toml(chosen)
        text = as_toml(same_run) + plan.to_toml() + layer + as_toml(self.evaluation)
        return hashlib.sha256(text.encode()).hexdigest()


def _inverting_problems(plan: RoundPlan, layer: str, settings: object) -> list[str]:
    """A plan whose method releases statistics that invert, without DP and without a record floor: every silo
    would refuse its rounds (`tail_guard.inverting_problems`), so say so now, with the two ways out."""
    fields, _ = plan.build_method().statistics_plan()
    inverting = [f.name for f in fields if f.per_class and f.inverts]
    if not inverting or plan.dp.enabled or guard_of(settings).min_records:
        return []
    return [
        f"method.name: {plan.method.name} releases per-class {', '.join(inverting)} of records, which give "
        "the records back to whoever reads the sums, at any class size (docs/threat-model.md); silos release "
        f"them only under DP by default: enable [dp] in the plan, or set [{layer}] min_records to a record "
        "floor every silo accepts too (policy.min_class_records), knowing it stops only the one- and "
        "two-record cases"
    ]


def load_consortium_config(path: str | Path) -> ConsortiumConfig:
    path = Path(path)
    config, problems = _parse(read_toml(path), path.parent)
    if config.server.default_study:
        problems += id_problems(config.server.default_study, "server.default_study")
    problems += [
        f"server.study_models: {entry!r} is not an entry point package.module:factory"
        for entry in config.server.study_models
        if parse_entry(entry) is None
    ]
    if problems:
        raise ConfigError(path, problems)
    return config


def load_study_config(study: str, text: str, base: ConsortiumConfig) -> ConsortiumConfig:
    """A study file (`python -m aggregator study create`): consortium.toml's sections of a run, without
    [server], whose settings are the aggregator's (the study's data goes to `studies/<id>/` of its data_dir);
    the consortium is the aggregator's. Raises `BadStudy` with every problem."""
    problems = id_problems(study, "id")
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadStudy([f"not valid TOML: {exc}"]) from None
    if "server" in tree:
        problems.append("[server]: a study file has none; the aggregator's own [server] serves every study")
    if "model" not in tree:
        problems.append(
            "[model]: a study file names its model (name, image_shape or its table's columns, classes); the "
            "defaults are a demo's, not a study's"
        )
    problems += [
        f"{where}: the aggregator's, set in consortium.toml for every study"
        for where, table in (("consortium.exit_when_done", "consortium"), ("timeouts.keepalive", "timeouts"))
        if isinstance(tree.get(table), dict) and where.split(".")[1] in tree[table]
    ]
    consortium = tree.setdefault("consortium", {})
    if isinstance(consortium, dict):
        named = consortium.setdefault("id", base.consortium.id)
        if named != base.consortium.id:
            problems.append(
                f"consortium.id: {named!r}, but this aggregator serves consortium {base.consortium.id!r}; "
                "leave it out"
            )
    config, found = _parse(tree, base.base_dir)
    problems += found
    model = config.plan.model.name
    if parse_entry(model) is not None and model not in base.server.study_models:
        problems.append(
            f"model.name: {model!r} is an entry point the aggregator would import and call; a created study "
            "may name only built-in models and the entry points [server] study_models of consortium.toml "
            "lists"
        )
    if problems:
        raise BadStudy(problems)
    data_dir = Path(base.server.data_dir) / STUDIES / study
    return replace(config, server=replace(base.server, data_dir=str(data_dir), default_study=""))


def _parse(tree: dict, base_dir: Path) -> tuple[ConsortiumConfig, list[str]]:
    """The config a file's tree describes, and every problem found in it."""
    plan_tree = {k: tree.pop(k) for k in ("model", "train", "method", "selection", "dp", "data") if k in tree}
    problems: list[str] = []
    sections_of_layers = layer_sections()
    sections = {
        name: parse_section(cls, tree.pop(name, {}), name, problems)
        for name, cls in (
            ("consortium", ConsortiumSection),
            ("server", ServerSection),
            ("timeouts", TimeoutSection),
            *sections_of_layers.items(),
            ("evaluation", EvaluationSection),
            ("metrics", ShotThresholds),
            ("retention", Retention),
            ("monitoring", MonitoringSection),
        )
    }
    plan = parse_section(RoundPlan, plan_tree, "", problems)
    problems += plan.problems()
    per_round = plan.selection.per_round
    privacy = sections["consortium"].privacy
    for name in sections_of_layers:
        problems += sections[name].problems()
        if name == privacy:
            problems += sections[name].consortium_problems(sections["consortium"].min_silos, per_round)
            if not problems:
                problems += _inverting_problems(plan, name, sections[name])
    if 0 < per_round < sections["consortium"].min_silos:
        problems.append(
            f"selection.per_round: {per_round} silos a round cannot make consortium.min_silos "
            f"({sections['consortium'].min_silos}) contributions"
        )
    problems += sections["monitoring"].problems()
    problems += [f"{key}: unknown section or setting" for key in tree]
    evaluation = sections["evaluation"]
    problems += evaluation.problems(privacy, len(plan.model.classes))
    sections["evaluation"] = replace(evaluation, held_out=evaluation.held_out_for(privacy))
    chosen = {name: sections.pop(name) for name in sections_of_layers}
    return ConsortiumConfig(plan=plan, base_dir=base_dir, layers=chosen, **sections), problems
