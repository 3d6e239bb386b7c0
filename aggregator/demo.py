"""`python -m aggregator demo`: a consortium on one machine, as an operator and silos would run it.

It creates a consortium CA and certificates, writes `consortium.toml` and one `silo.toml` per silo, starts the
aggregator and the silo agents as separate processes on 127.0.0.1 over mutual TLS, and shows the aggregator's
progress. The silos' data are the shards of the embedded long-tailed MNIST-5k recipe, so the demo also knows
the class counts that the aggregator reports shot groups with. Ctrl-C stops every process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from aggregator.config import ConsortiumSection, EvaluationSection, ServerSection, TimeoutSection
from fedlt.aggregation import record
from fedlt.aggregation.registry import DEFAULT_LAYER
from fedlt.config import as_table, render_toml
from fedlt.data.federation import DataConfig, build_federation
from fedlt.errors import FedltError
from fedlt.keepalive import MIN_SECONDS
from fedlt.methods import METHODS, MethodChoice, TrainConfig
from fedlt.plan import ModelSection, RoundPlan
from fedlt.recorder import METRICS
from fedlt.reports import comparison_table, plot_comparison
from fedlt.selection import DISCLOSURE
from privacy.pki.ca import init_ca, issue_operator, issue_server, issue_silo
from privacy.pki.roster import draft

RECIPE = DataConfig(dataset="mnist5k", imbalance=100.0, alpha=0.5, silos=4)
DEMO_PLAN = RoundPlan(
    model=ModelSection(name="cnn", image_shape=(1, 28, 28)),
    train=TrainConfig(local_epochs=2, batch_size=32, lr=0.05, momentum=0.9),
)
STARTUP_SECONDS = 60
# FedAvg, then fedlt's long-tail recipe on the same silos (`fedlt.methods.balanced`)
DEMO_METHODS = ("fedavg", "balanced")


class DemoError(FedltError):
    """A demo process failed to start or stopped early."""


def write_consortium(
    directory: Path,
    *,
    recipe: DataConfig,
    plan: RoundPlan,
    consortium: ConsortiumSection,
    timeouts: TimeoutSection,
    silo_threads: int = 0,
    layer_settings: object | None = None,
    record_floor: int = 0,
) -> tuple[Path, list[Path]]:
    """CA, certificates, the roster and config files for a consortium on this machine, one silo per shard.

    The silo configs name the aggregator as ADDRESS until it is known (`point_silos_at`). `record_floor` > 0:
    the layer's record floor, which every silo's policy accepts too, for a method releasing statistics that
    invert without DP (off by default: they give the records back).
    """
    pki = directory / "pki"
    init_ca(pki / "ca", name=f"{consortium.id} CA")
    aggregator = issue_server(pki / "ca", pki, hosts=["127.0.0.1", "localhost"])
    issue_operator(pki / "ca", pki, name="operator")
    silo_ids = [f"silo-{k}" for k in range(recipe.silos)]
    silo_certs = [issue_silo(pki / "ca", pki, silo_id=silo_id).certificate for silo_id in silo_ids]
    roster = draft(
        consortium.id,
        aggregator=aggregator.certificate.read_bytes(),
        silos=[(silo_id, cert.read_bytes()) for silo_id, cert in zip(silo_ids, silo_certs, strict=True)],
    )
    (pki / "roster.json").write_bytes(roster.to_json())
    counts = build_federation(recipe, seed=consortium.seed).train_counts.tolist()
    server = ServerSection(
        listen="127.0.0.1:0",
        ca="pki/ca/ca.pem",
        crl="pki/ca/crl.pem",
        roster="pki/roster.json",
        status_page="127.0.0.1:0",
    )
    evaluation = EvaluationSection(
        dataset=recipe.dataset, test_per_class=recipe.test_per_class, class_counts=tuple(counts)
    )
    tree = {
        "consortium": as_table(consortium),
        "server": as_table(server),
        "timeouts": as_table(timeouts),
        **{k: v for k, v in as_table(plan).items() if k != "rounds"},  # rounds: [consortium] says
        "evaluation": as_table(evaluation),
    }
    if layer_settings is not None:  # the chosen layer's own section
        tree[consortium.privacy] = as_table(layer_settings)
    if record_floor:
        tree.setdefault(consortium.privacy, {})["min_records"] = record_floor
    path = directory / "consortium.toml"
    path.write_text(f"# A consortium on this machine, written by aggregator.demo.\n{render_toml(tree)}")
    silo_configs = []
    for k in range(recipe.silos):
        silo = {
            "state_dir": f"silo-{k}-state",
            "connection": {
                "aggregator": "ADDRESS",
                "ca": "pki/ca/ca.pem",
                "certificate": f"pki/silo-{k}.pem",
                "key": f"pki/silo-{k}.key",
                "roster": "pki/roster.json",
                "heartbeat_seconds": 2.0,
                "keepalive_seconds": MIN_SECONDS,
                "max_backoff_seconds": 4.0,
            },
            "data": {"source": "embedded", "index": k, "seed": consortium.seed, "recipe": as_table(recipe)},
            "policy": {
                "methods": [plan.method.name],
                "privacy": [consortium.privacy],
                "disclosures": [DISCLOSURE] if plan.selection.discloses else [],
                "min_class_records": record_floor,
            },
            "compute": {"threads": silo_threads},
            # where only silos hold the model (ckks), each evaluates its share of the recipe's test split
            "evaluation": {"part": k, "parts": recipe.silos},
        }
        silo_path = directory / f"silo-{k}.toml"
        silo_path.write_text(f"# Silo {k}: shard {k} of the embedded recipe.\n{render_toml(silo)}")
        silo_configs.append(silo_path)
    return path, silo_configs


def point_silos_at(address: str, silo_configs: list[Path]) -> None:
    for path in silo_configs:
        path.write_text(path.read_text().replace('"ADDRESS"', f'"{address}"'))


def wait_for_address(data_dir: Path, process: subprocess.Popen, timeout: float = STARTUP_SECONDS) -> str:
    """The address the aggregator bound (it may have asked the OS for a free port)."""
    until = time.monotonic() + timeout
    listening = data_dir / "listening.json"
    while time.monotonic() < until:
        if process.poll() is not None:
            raise DemoError(f"the aggregator exited with code {process.returncode} before listening")
        if listening.exists():
            info = json.loads(listening.read_text())
            if info["pid"] == process.pid:
                return info["address"]
        time.sleep(0.2)
    raise DemoError(f"the aggregator did not start listening within {timeout:.0f} s")


def stop_all(processes: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    until = time.monotonic() + grace
    for p in processes:
        try:
            p.wait(max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def demo_layer_settings(privacy: str) -> object | None:
    """The demo's section for a layer that needs one: a layer with a key service names its key holder (the
    first silo)."""
    layer = record(privacy)
    return None if layer.key_service is None else replace(layer.settings(), key_holder="silo-0")


def run_demo(
    directory: Path,
    *,
    silos: int,
    rounds: int,
    privacy: str = DEFAULT_LAYER,
    methods: Sequence[str] = DEMO_METHODS,
) -> int:
    """One consortium run per method, each in `directory/<method>/`, then their accuracies side by side."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise DemoError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for k, name in enumerate(methods, 1):
        print(f"\n== {name} ({k} of {len(methods)}) ==", flush=True)
        code = run_consortium(directory / name, silos=silos, rounds=rounds, privacy=privacy, method=name)
        if code != 0:
            return code
    if len(methods) > 1:
        print_comparison(directory, methods)
    return 0


def print_comparison(directory: Path, methods: Sequence[str]) -> None:
    """The runs' final accuracies side by side, from each aggregator's metrics and evaluation settings."""
    runs = {
        name: json.loads((directory / name / "aggregator-data" / "run" / METRICS).read_text())
        for name in methods
    }
    first = runs[methods[0]]
    evaluation = tomllib.loads((directory / methods[0] / "consortium.toml").read_text())["evaluation"]
    classes, counts = first["plan"]["model"]["classes"], evaluation["class_counts"]
    rules = {group: facts["rule"] for group, facts in first["shot_groups"].items()}
    finals = {name: run["final"] for name, run in runs.items()}
    print(f"\nthe same silos, {' against '.join(methods)}: final test accuracy")
    print(comparison_table(finals, classes, counts, rules))
    plot = directory / "comparison.png"
    title = f"LT {RECIPE.dataset} (IF {RECIPE.imbalance:g}), the same silos: {', '.join(methods)}"
    plot_comparison(finals, classes, counts, plot, title)
    print(f"per-class plot: {plot}")


def run_consortium(directory: Path, *, silos: int, rounds: int, privacy: str, method: str) -> int:
    directory.mkdir(parents=True)
    print(f"setting up a consortium of {silos} silos in {directory}/ (CA, certificates, configs) ...")
    recipe = replace(RECIPE, silos=silos)
    consortium, silo_configs = write_consortium(
        directory,
        recipe=recipe,
        plan=replace(DEMO_PLAN, method=MethodChoice(method, METHODS[method].Options())),
        consortium=ConsortiumSection(id="fedlt-demo", rounds=rounds, min_silos=silos, privacy=privacy),
        layer_settings=demo_layer_settings(privacy),
        timeouts=TimeoutSection(gather=5.0, round=120.0),
        # the silos share this machine's cores; on machines of their own they would use all of theirs
        silo_threads=max(1, (os.cpu_count() or 1) // silos),
    )
    logs = directory / "logs"
    logs.mkdir()
    aggregator = subprocess.Popen(
        [sys.executable, "-m", "aggregator", "serve", "--config", str(consortium)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    processes = [aggregator]
    try:
        address = wait_for_address(directory / "aggregator-data", aggregator)
        point_silos_at(address, silo_configs)
        for k, path in enumerate(silo_configs):
            with (logs / f"silo-{k}.log").open("w") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "silo", "run", "--config", str(path)], stdout=log, stderr=log
                    )
                )
        print(f"started the aggregator on {address} and {silos} silo agents (logs in {logs}/)")
        assert aggregator.stdout is not None
        for line in aggregator.stdout:
            print(line, end="", flush=True)
        code = aggregator.wait()
        for p in processes[1:]:
            p.wait(timeout=30)
        return code
    except KeyboardInterrupt:
        print("\nstopping the consortium ...", file=sys.stderr)
        return 130
    finally:
        stop_all(processes)
