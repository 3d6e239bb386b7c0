"""A whole consortium in one process: every silo's half, the privacy layer and the server half, in rounds.

After each round the global state and the metrics so far are written atomically to the run folder, so a
killed run loses at most the round in flight and the same command resumes it. All randomness is derived from
(seed, round, silo), which makes a resumed run identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedlt.aggregation import make_layer
from fedlt.atomic import atomic_write, atomic_write_text
from fedlt.config import as_table, as_toml
from fedlt.data.federation import Federation, build_federation
from fedlt.errors import FedltError
from fedlt.methods import GlobalState, Method, ModelSpec, ServerContext, SiloContext, method_class
from fedlt.metrics import evaluate
from fedlt.models import DEFAULT_FOR_SIDE
from fedlt.reports import accuracy_table, percent, plot_curves, plot_per_class
from fedlt.sim.config import SimConfig

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.json"


class RunFolderError(FedltError):
    """The run folder holds a checkpoint this run cannot continue."""


@dataclass(frozen=True)
class RunResult:
    metrics: dict
    table: str
    state: GlobalState


def run_simulation(
    config: SimConfig,
    out: Path,
    *,
    echo: Callable[[str], None] = print,
    on_round: Callable[[int, dict], None] | None = None,
) -> RunResult:
    federation = build_federation(config.data, seed=config.seed)
    method = _make_method(config, federation)
    layer = make_layer(config.privacy)
    groups = config.metrics.groups(federation.train_counts)
    out.mkdir(parents=True, exist_ok=True)
    state, rounds = _resume(out, config) or (method.init_state(seed=config.seed), [])
    if rounds:
        echo(f"resuming {out} after round {state.round}")
    metrics = _metrics_header(config, federation, groups)
    for r in range(state.round + 1, config.rounds + 1):
        started = time.perf_counter()
        contributions = [
            method.local_round(state, silo, SiloContext(r, f"silo-{k}", config.seed))
            for k, silo in enumerate(federation.silos)
        ]
        sums = layer.aggregate(method.schema(state), contributions)
        state = method.server_step(state, sums, ServerContext(r, config.seed))
        report = evaluate(method.eval_model(state), federation.test, groups)
        entry = {
            "round": r,
            **report,
            "clipped_values": sum(c.clipped for c in contributions),
            "seconds": round(time.perf_counter() - started, 3),
            "state_digest": state.digest(),
        }
        rounds.append(entry)
        _save(out, config, state, rounds, metrics)
        echo(
            f"round {r:>4}/{config.rounds}  acc {percent(entry['accuracy'])}  many {percent(entry['many'])}"
            f"  medium {percent(entry['medium'])}  few {percent(entry['few'])}  ({entry['seconds']:.1f} s)"
        )
        if on_round is not None:
            on_round(r, entry)
    metrics["rounds"] = rounds
    metrics["final"] = rounds[-1]
    atomic_write_text(out / METRICS, json.dumps(metrics, indent=1))
    data = config.data
    title = f"{config.method.name} on {data.dataset}, IF {data.imbalance:g}, α {data.alpha:g}"
    plot_curves(rounds, out / "accuracy.png", title)
    plot_per_class(
        rounds[-1], federation.classes, federation.train_counts, groups, out / "per_class.png", title
    )
    table = accuracy_table(rounds[-1], federation.classes, federation.train_counts, config.metrics.rules())
    return RunResult(metrics, table, state)


def _make_method(config: SimConfig, federation: Federation) -> Method:
    shape = federation.test.image_shape
    name = config.model.name if config.model.name != "auto" else DEFAULT_FOR_SIDE.get(shape[1], "resnet8")
    cls = method_class(config.method.name)
    return cls(
        options=config.method.options,
        train=config.train,
        model=ModelSpec(name, shape, len(federation.classes)),
    )


def _metrics_header(config: SimConfig, federation: Federation, groups: dict[str, list[int]]) -> dict:
    return {
        "config": as_table(config),
        "dataset": {
            "name": config.data.dataset,
            "classes": list(federation.classes),
            "train_counts": federation.train_counts.tolist(),
            "test_counts": federation.test.class_counts().tolist(),
            "silo_sizes": [len(s) for s in federation.silos],
            "label_skew_tv": round(federation.label_skew, 4),
        },
        "shot_groups": {
            g: {"rule": rule, "classes": groups[g]} for g, rule in config.metrics.rules().items()
        },
    }


def _save(out: Path, config: SimConfig, state: GlobalState, rounds: list[dict], header: dict) -> None:
    checkpoint = {
        "fingerprint": config.fingerprint(),
        "round": state.round,
        "model": dict(state.model),
        "extra": dict(state.extra),
        "rounds": rounds,
    }
    atomic_write(out / CHECKPOINT, lambda fh: torch.save(checkpoint, fh))
    atomic_write_text(out / METRICS, json.dumps({**header, "rounds": rounds}, indent=1))
    atomic_write_text(out / "config.toml", as_toml(config))


def _resume(out: Path, config: SimConfig) -> tuple[GlobalState, list[dict]] | None:
    path = out / CHECKPOINT
    if not path.exists():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["fingerprint"] != config.fingerprint():
        raise RunFolderError(
            f"{out} holds a run with different settings (see {out / 'config.toml'}); "
            "choose another --out or pass --fresh to discard it"
        )
    if saved["round"] > config.rounds:
        raise RunFolderError(
            f"{out} already holds {saved['round']} rounds, more than the {config.rounds} asked for; "
            "ask for at least as many rounds, choose another --out, or pass --fresh"
        )
    return GlobalState(saved["round"], saved["model"], saved["extra"]), saved["rounds"]
