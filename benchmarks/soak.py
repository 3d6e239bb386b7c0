"""Soak: a consortium of real processes over many secure rounds; is memory flat, how fast does the file grow?

    python benchmarks/soak.py [--rounds 500] [--silos 4] [--privacy secagg] [--every 0] [--out runs/soak]

Runs the test consortium's settings (scikit-learn digits, the small CNN, FedAvg, one local epoch) with the
aggregator and every silo agent as separate processes over mutual TLS on 127.0.0.1, samples each process's
resident memory (VmRSS) and the SQLite file (with its WAL) every few seconds against the committed round, and
writes `soak.json` and `soak.png` to `--out`. Growth is the least-squares slope over the rounds after the
first tenth (start-up and the first rounds' allocations are not growth). `--every` is `[retention] every`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from procfs import status_kb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.consortium_harness

SAMPLE_SECONDS = 2.0


def rss_mb(pid: int) -> float | None:
    kb = status_kb(pid, ("VmRSS",)).get("VmRSS")
    return None if kb is None else kb / 1024


def committed_round(database: Path) -> int:
    if not database.exists():
        return -1
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30) as db:
        (latest,) = db.execute("SELECT COALESCE(MAX(round), -1) FROM states").fetchone()
    return int(latest)


def file_mb(database: Path) -> float:
    parts = [database, database.with_name(database.name + "-wal")]
    return sum(p.stat().st_size for p in parts if p.exists()) / 2**20


def last_known(samples: list[dict], key: str) -> float:
    """The last sample of a process that has exited since (silos leave before the aggregator's last look)."""
    return next((s[key] for s in reversed(samples) if s[key] is not None), float("nan"))


def slope_per_100(samples: list[dict], key: str, first_round: int) -> float:
    """Least-squares growth of `key` per 100 rounds, over samples from `first_round` on."""
    points = [(s["round"], s[key]) for s in samples if s["round"] >= first_round and s[key] is not None]
    if len(points) < 3:
        return float("nan")
    rounds, values = np.array(points, dtype=float).T
    return float(np.polyfit(rounds, values, 1)[0] * 100)


def soak(n_rounds: int, silos: int, privacy: str, every: int, out: Path) -> dict:
    from dataclasses import replace

    from aggregator.config import ConsortiumSection, TimeoutSection
    from aggregator.demo import demo_layer_settings, write_consortium
    from tests.consortium_harness import PLAN, RECIPE, SILO_THREADS, Consortium

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _, configs = write_consortium(
            directory,
            recipe=replace(RECIPE, silos=silos),
            plan=PLAN,
            consortium=ConsortiumSection(id="soak", rounds=n_rounds, min_silos=silos, privacy=privacy),
            timeouts=TimeoutSection(gather=5.0, round=300.0),
            silo_threads=SILO_THREADS,
            layer_settings=demo_layer_settings(privacy),
        )
        config = directory / "consortium.toml"
        config.write_text(config.read_text() + f"\n[retention]\nlast = 3\nevery = {every}\n")
        consortium = Consortium(directory, configs)
        database = consortium.data_dir / "consortium.sqlite"
        samples: list[dict] = []
        started = time.monotonic()
        try:
            consortium.start()
            assert consortium.aggregator is not None
            while consortium.aggregator.poll() is None:
                sample = {
                    "seconds": round(time.monotonic() - started, 1),
                    "round": committed_round(database),
                    "aggregator_mb": rss_mb(consortium.aggregator.pid),
                    "db_mb": file_mb(database),
                }
                for k, process in consortium.silos.items():
                    sample[f"silo-{k}_mb"] = rss_mb(process.pid)
                samples.append(sample)
                if len(samples) % 30 == 0:
                    print(
                        f"round {sample['round']}/{n_rounds}  aggregator {sample['aggregator_mb']:.0f} MB  "
                        f"silo-0 {sample['silo-0_mb']:.0f} MB  file {sample['db_mb']:.1f} MB",
                        flush=True,
                    )
                time.sleep(SAMPLE_SECONDS)
            code = consortium.wait_aggregator(timeout=60)
        finally:
            consortium.stop()
        final_mb = file_mb(database)
    if code != 0:
        raise SystemExit(f"the aggregator exited with code {code}")
    warm = max(1, n_rounds // 10)
    keys = ["aggregator_mb", *(f"silo-{k}_mb" for k in range(silos))]
    late = [s for s in samples if s["round"] >= warm]
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": " ".join(["python benchmarks/soak.py", *sys.argv[1:]]),
        "rounds": n_rounds,
        "silos": silos,
        "privacy": privacy,
        "retention": {"last": 3, "every": every},
        "wall_seconds": round(samples[-1]["seconds"], 1) if samples else 0.0,
        "rss_mb_after_warmup": {k: round(late[0][k], 1) for k in keys} if late else {},
        "rss_mb_at_end": {k: round(last_known(samples, k), 1) for k in keys},
        "rss_growth_mb_per_100_rounds": {k: round(slope_per_100(samples, k, warm), 2) for k in keys},
        "db_mb_final": round(final_mb, 2),
        "db_growth_kb_per_round": round(slope_per_100(samples, "db_mb", warm) * 1024 / 100, 2),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({**result, "samples": samples}, indent=1))
    plot(samples, keys, out / "soak.png", n_rounds)
    return result


def plot(samples: list[dict], keys: list[str], path: Path, n_rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, disk) = plt.subplots(1, 2, figsize=(11, 4))
    for key in keys:
        points = [(s["round"], s[key]) for s in samples if s["round"] >= 0 and s[key] is not None]
        if points:
            memory.plot(*zip(*points, strict=True), label=key.removesuffix("_mb"))
    memory.set(xlabel="round committed", ylabel="resident memory (MB)", title="memory per process")
    memory.legend(fontsize=8)
    disk.plot([s["round"] for s in samples], [s["db_mb"] for s in samples])
    disk.set(xlabel="round committed", ylabel="MB", title="consortium.sqlite (+ WAL)")
    fig.suptitle(f"soak: {n_rounds} secure rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--silos", type=int, default=4)
    p.add_argument("--privacy", default="secagg", choices=("secagg", "plaintext"))
    p.add_argument("--every", type=int, default=0, help="[retention] every: also keep every m-th state")
    p.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = p.parse_args()
    result = soak(args.rounds, args.silos, args.privacy, args.every, args.out)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
