"""Load: 3, 10 and 30 silo processes through whole secure rounds, the complete graph beside SecAgg+'s.

    python benchmarks/load.py [--silos 3 10 30] [--rounds 6] [--pairs 2] [--model cnn-small]
        [--budget-minutes 20] [--keep DIR] [--out runs/load]

For each n it runs a real consortium (`secagg.consortium_run`: the aggregator and n silo agents as separate
processes over mutual TLS on 127.0.0.1, one torch thread each, FedAvg, the demo's training plan) with privacy
`secagg`, once with the complete graph (Bonawitz: every silo masks with and shares to every other) and once
with SecAgg+'s sparse Harary graph of `secagg.secagg_plus_degree(n)` = 2⌈log2 n⌉ neighbours. At n = 3 that
degree gives the complete graph again, so the two n = 3 runs are the same configuration: their difference is
the run-to-run noise. Silos refuse sparse graphs by default (`policy.min_neighbours = 0`); here every silo's
policy sets `min_neighbours` to the degree asked, so that they take part.

The model is the tests' small CNN on 8×8 digits (IF 10, α 0.5, 22,603 words a contribution), so that 30
processes fit on a small machine; its mask stream is small, so what the graph changes is the per-peer work
(key agreements, envelopes, shares). `--model resnet8` (1,229,131 words, on LT MNIST-5k) makes the masks'
n × words PRG work dominate. Runs alternate full and SecAgg+, the order flipping at every pair and carried
from one n to the next (full, SecAgg+, SecAgg+, full at every n with 2 pairs; with 1 pair, full first at every
other n), so a drift of this shared machine favours neither.

Each run reports, from the aggregator's audit log (`secagg.round_times`, `secagg.pooled`): seconds between
consecutive commits (the first round, which includes start-up and the census, excluded), and that time split
into attempt start → last (masked) contribution accepted (training and the keys, shares and masked-input
stages) → commit (consistency and unmask stages, server step, commit) → next attempt start (evaluation);
rounds committed against rounds asked. While the processes run a thread polls `/proc/<pid>/status` for the
peak resident memory (VmHWM, which is gone once a process exits) of the aggregator and every silo, the sum of
every process's proportional set size (Pss: shared library pages split between the processes that map them,
so the sum is what the consortium takes from this machine), and CPU times, so that the CPU other work on the
machine took during the run can be stated. The bytes each silo sends and receives in one secure sum come
from `secagg.session_costs` in this process (serialized Protobuf, no gRPC/TLS framing).

JSON goes to stdout and `--out`/load.json, the markdown table to stderr and `--out`/load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import secagg  # benchmarks/secagg.py: the consortium run, its audit-log times, the machine line
from procfs import cpu_seconds, loadavg, machine_busy_seconds, pss_kb, status_kb

from privacy.secagg.settings import SecAggSettings
from tests.consortium_harness import SILO_THREADS, Consortium

POLL_SECONDS = 0.5


@contextmanager
def watch(consortium: Consortium) -> Iterator[dict]:
    """Peak memory and CPU time of the consortium's processes, polled every POLL_SECONDS while they run.

    Yields a dict that is filled in when the block ends: per process (aggregator, silo-k) the highest VmHWM
    seen in MB and the last CPU seconds seen; the highest sum of Pss over the processes alive; and the CPU
    seconds the whole machine was busy, of which `others_cpu_s` were not ours (neither these processes nor
    this benchmark). A process's last poll falls at most POLL_SECONDS before it exits, so its final moments
    are not counted; its peak is a high-water mark and so is still counted up to then.
    """
    peak_kb: dict[str, int] = {}
    cpu: dict[str, float] = {}
    pss_peak = [0]
    samples = [0]
    stop = threading.Event()

    def processes() -> list[tuple[str, int]]:
        found = [] if consortium.aggregator is None else [("aggregator", consortium.aggregator.pid)]
        try:
            silos = sorted(consortium.silos.items())
        except RuntimeError:  # the dict grew while being read (silos are starting): next poll
            silos = []
        return found + [(f"silo-{k}", p.pid) for k, p in silos]

    def poll() -> None:
        while not stop.wait(POLL_SECONDS):
            pss = 0
            for name, pid in processes():
                hwm = status_kb(pid, ("VmHWM",)).get("VmHWM")
                if hwm is not None:
                    peak_kb[name] = max(peak_kb.get(name, 0), hwm)
                    pss += pss_kb(pid)
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    cpu[name] = seconds
            pss_peak[0] = max(pss_peak[0], pss)
            samples[0] += 1

    result: dict = {}
    busy, own, load, started = machine_busy_seconds(), os.times(), loadavg(), time.monotonic()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield result
    finally:
        stop.set()
        poller.join()
        machine = machine_busy_seconds() - busy
        ours = sum(cpu.values()) + (os.times().user - own.user) + (os.times().system - own.system)
        silos = {k: v for k, v in peak_kb.items() if k != "aggregator"}
        result |= {
            "peak_mb": {k: round(v / 1024, 1) for k, v in peak_kb.items()},
            "aggregator_peak_mb": round(peak_kb.get("aggregator", 0) / 1024, 1) or None,
            "silo0_peak_mb": round(silos["silo-0"] / 1024, 1) if "silo-0" in silos else None,
            "silo_max_peak_mb": round(max(silos.values()) / 1024, 1) if silos else None,
            "silo_median_peak_mb": round(statistics.median(silos.values()) / 1024, 1) if silos else None,
            "pss_total_peak_mb": round(pss_peak[0] / 1024, 1),
            "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
            "wall_s": round(time.monotonic() - started, 1),
            "machine_busy_cpu_s": round(machine, 1),
            "others_cpu_s": round(max(0.0, machine - ours), 1),
            "loadavg_before": load,
            "loadavg_after": loadavg(),
            "samples": samples[0],
        }


def protocol_bytes(n: int, neighbours: int, model: str, members: secagg.Members) -> dict:
    """Bytes one silo sends and receives in one secure sum of this model's contribution (mean over silos)."""
    costs = secagg.session_costs(n, 1, secagg.contribution_schema(model), members, neighbours=neighbours)
    b = costs["bytes_per_silo"]
    return {"up": b["up_total"], "down": b["down_total"], "threshold": costs["threshold"]}


def summary(runs: list[dict], n_rounds: int) -> dict:
    """One graph's runs at one n: the audit-log medians (`secagg.pooled`) with the spread of the round
    time, rounds committed against asked, and memory peaks over the runs."""
    entry = secagg.pooled(runs)
    rounds = [x for r in runs for x in r["round_s"]]
    watched = [r["monitor"] for r in runs]

    def peak(key: str) -> float | None:
        values = [w[key] for w in watched if w.get(key) is not None]
        return max(values) if values else None

    return entry | {
        "round_s_min": round(min(rounds), 3) if rounds else None,
        "round_s_max": round(max(rounds), 3) if rounds else None,
        "round_s_quartiles": [round(q, 3) for q in statistics.quantiles(rounds, n=4)]
        if len(rounds) > 1
        else [],
        "rounds_committed": sum(r["rounds_committed"] for r in runs),
        "rounds_asked": n_rounds * len(runs),
        "attempts": sum(r["attempts"] for r in runs),
        **{key: peak(key) for key in ("aggregator_peak_mb", "silo0_peak_mb", "silo_max_peak_mb")},
        "silo_median_peak_mb": peak("silo_median_peak_mb"),
        "pss_total_peak_mb": peak("pss_total_peak_mb"),
        "others_cpu_s": [w["others_cpu_s"] for w in watched],
        "run_wall_s": [w["wall_s"] for w in watched],
        # cores' worth of CPU that other work on this machine took during these runs
        "others_cores": round(sum(w["others_cpu_s"] for w in watched) / sum(w["wall_s"] for w in watched), 2),
    }


def load(
    silos: list[int],
    *,
    n_rounds: int,
    pairs: int,
    model: str,
    silo_threads: int,
    budget_minutes: float,
    keep: str,
) -> dict:
    results = []
    flip = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(keep) if keep else Path(tmp)
        members = secagg.Members.issue(Path(tmp) / "members", max(silos))
        for n in silos:
            neighbours = {"full": 0, "secagg+": secagg.secagg_plus_degree(n)}
            runs: dict[str, list[dict]] = {graph: [] for graph in neighbours}
            for pair in range(pairs):
                order = list(neighbours)[:: -1 if flip else 1]
                flip = not flip
                for graph in order:
                    k = neighbours[graph]
                    print(
                        f"n = {n}, {graph} (k = {k or n - 1}), pair {pair + 1}/{pairs} ...", file=sys.stderr
                    )
                    run = secagg.consortium_run(
                        root / f"n{n}-{pair}-{graph}",
                        silos=n,
                        n_rounds=n_rounds,
                        privacy="secagg",
                        model=model,
                        silo_threads=silo_threads,
                        budget_s=60 * budget_minutes,
                        layer_settings=SecAggSettings(neighbours=k),
                        silo_policy={"min_neighbours": k} if k else None,
                        monitor=watch,
                    )
                    runs[graph].append(run)
                    print(
                        f"  {run['rounds_committed']}/{n_rounds} rounds, {run['wall_s']} s, "
                        f"aggregator {run['monitor']['aggregator_peak_mb']} MB, "
                        f"silo max {run['monitor']['silo_max_peak_mb']} MB, "
                        f"others' CPU {run['monitor']['others_cpu_s']} s",
                        file=sys.stderr,
                    )
            entry: dict = {"silos": n}
            for graph, k in neighbours.items():
                spec = SecAggSettings(neighbours=k).session(
                    "r", "contribution", [f"s{i:02}" for i in range(n)], 1, b""
                )
                entry[graph] = {
                    "neighbours": k,
                    "holders": spec.holder_count,
                    "threshold": spec.t,
                    "bytes_per_silo": protocol_bytes(n, k, model, members),
                    **summary(runs[graph], n_rounds),
                }
            full, sparse = entry["full"], entry["secagg+"]
            entry["ratio_secagg+_over_full"] = (
                round(sparse["round_s_median"] / full["round_s_median"], 3)
                if full["measured"] and sparse["measured"]
                else None
            )
            results.append(entry)
    return {
        "machine": secagg.machine(),
        "model": model,
        "dataset": secagg.recipe_for(model).dataset,
        "words": secagg.contribution_schema(model).size,
        "rounds": n_rounds,
        "pairs": pairs,
        "silo_threads": silo_threads,
        "budget_minutes": budget_minutes,
        "poll_seconds": POLL_SECONDS,
        "by_silos": results,
    }


def table(result: dict) -> str:
    """Markdown: one row per n and graph."""
    rows = [
        "| n | graph (k) | t | rounds committed / asked | s/round, median (min–max) | start → last masked "
        "input / → commit / → next start (s) | aggregator peak MB | silo-0 peak MB | max silo peak MB | "
        "all processes, Pss peak MB | bytes up + down per silo, one sum | other work, cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["by_silos"]:
        n = entry["silos"]
        for graph in ("full", "secagg+"):
            r = entry[graph]
            k = r["neighbours"] or n - 1
            label = "full" if graph == "full" else "SecAgg+" + (" (= full)" if not r["neighbours"] else "")
            if r["measured"]:
                time_cell = f"{r['round_s_median']:.2f} ({r['round_s_min']:.2f}–{r['round_s_max']:.2f})"
                phases = " / ".join(f"{r[f'{p}_median']:.2f}" for p in secagg.PHASES[1:])
            else:
                time_cell, phases = "not measured", r["reason"]
            b = r["bytes_per_silo"]
            rows.append(
                f"| {n} | {label} ({k}) | {r['threshold']} | {r['rounds_committed']} / {r['rounds_asked']} | "
                f"{time_cell} | {phases} | {r['aggregator_peak_mb']} | {r['silo0_peak_mb']} | "
                f"{r['silo_max_peak_mb']} | {r['pss_total_peak_mb']} | {b['up']:,} + {b['down']:,} | "
                f"{r['others_cores']} |"
            )
    ratios = ", ".join(
        f"n = {e['silos']}: {e['ratio_secagg+_over_full']}"
        for e in result["by_silos"]
        if e["ratio_secagg+_over_full"]
    )
    return "\n".join(rows) + f"\n\nSecAgg+ / full, median s/round: {ratios}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, nargs="+", default=[3, 10, 30])
    parser.add_argument(
        "--rounds", type=int, default=6, help="per run; the first is excluded from the median"
    )
    parser.add_argument("--pairs", type=int, default=2, help="full/SecAgg+ runs each, in alternating order")
    parser.add_argument(
        "--model", default="cnn-small", help="cnn-small (8×8 digits), cnn or resnet8 (MNIST-5k)"
    )
    parser.add_argument("--silo-threads", type=int, default=SILO_THREADS, help="torch threads per silo")
    parser.add_argument("--budget-minutes", type=float, default=20.0, help="per run; beyond it, not measured")
    parser.add_argument("--keep", default="", help="keep the consortium directories (logs, database) here")
    parser.add_argument("--out", type=Path, default=Path("runs/load"), help="load.json and load.md go here")
    args = parser.parse_args()
    result = load(
        args.silos,
        n_rounds=args.rounds,
        pairs=args.pairs,
        model=args.model,
        silo_threads=args.silo_threads,
        budget_minutes=args.budget_minutes,
        keep=args.keep,
    )
    result["command"] = " ".join(["python benchmarks/load.py", *sys.argv[1:]])
    markdown = table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(result, indent=1))
    (args.out / "load.md").write_text(markdown + "\n")
    print(json.dumps(result, indent=1))
    print(markdown, file=sys.stderr)


if __name__ == "__main__":
    main()
