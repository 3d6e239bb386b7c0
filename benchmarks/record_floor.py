"""How many records a class needs before its released moments stop giving them away: the record floor.

    python benchmarks/record_floor.py [--records 1 2 3 4 5 6 7 8] [--seeds 0 1 2] [--classes 6 7 8 9]
        [--pool 24] [--restarts 4] [--release secagg|plaintext] [--config configs/audit.toml]
        [--threads 1] [--out runs/record_floor.json]

The tail guard lets a class's per-class rows leave when k_min silos hold it, however few records that is;
a record floor r_min would also ask for r_min records. This measures what Σz, Σzzᵀ and the count of n
records of one class give an honest-but-curious aggregator, for each n of --records, with the audit's
moment attack (`attacks.moments.invert_moments`: the rotation the sums leave free chosen to make the
post-ReLU features non-negative).

The setting is the audit's (`attacks.scenario.build_scenario` on --config: long-tailed MNIST-5k, IF 100, 4
silos, FedAvg trained for a few rounds as the encoder). Victims are images of the split's few-shot classes
(fewer than 20 training records) unless --classes names others: for each class, --pool images of the
attacker's held-out split are set aside, and each trial (class, seed) draws n of them. The silos hold too
few records of those classes to draw 8 (the audit plants one or two per class), so the pool stands in for
them: images the encoder never trained on, post-ReLU features like any record's (58% of the entries zero
on the held-out split). The attacker keeps the rest of the held-out split: its prior for a class is that
data's mean feature, and the audit's decoder (`attacks.decoder.train_decoder`) is trained on it alone, so
no victim is seen by it.

Each trial computes the victims' release the way a silo holding them would: CCVR's closing-round
`local_round` on the trained backbone (features clipped to its `feature_bound`), then, with --release
secagg (the default layer), through the secure sum's fixed-point codec for the federation's silo count (Σz
at 24 fractional bits and Σzzᵀ at 16 in the audit's 4-silo round; the masks cancel exactly and are left
out); --release plaintext keeps the float64 sums. It then scores, per true record, the relative L2
distance to the nearest recovered record (`attacks.moments.record_errors`): the best-recovered record's
and the worst's, beside the same for the attacker's prior (no release) and for the released mean alone
(Σz / n, no Σzzᵀ). Images: the decoder draws each recovered feature, paired one to one with the victims
by SSIM (`attacks.scoring.best_match`), and the best pair's SSIM is set against the prior's image and the
mean's (best over the victims) and the decoder's ceiling (the victims' true features, decoded).

The criterion for r_min: the smallest n at which the median best-record error of the attack is no lower
than the median best-record error of the prior, i.e. the moments no longer bring the attacker's closest
guess nearer to any record than its own data does. Medians are over classes × seeds, with min–max beside.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from attacks.audit import Audit
from attacks.config import load_audit_config
from attacks.decoder import decode, prior, train_decoder
from attacks.moments import RESTARTS, invert_moments, record_errors
from attacks.scenario import attacked_state, build_scenario, method_for
from attacks.scoring import best_match, per_image
from fedlt.data.arrays import LabeledData
from fedlt.errors import FedltError
from fedlt.methods import SiloContext
from fedlt.methods.heads import extract_features
from fedlt.metrics import ShotThresholds
from privacy.ring import FixedPointCodec

ROOT = Path(__file__).resolve().parent.parent
MIN_ATTACKER_IMAGES = 20  # per victim class left to the attacker, for its prior and its decoder
RELEASES = ("secagg", "plaintext")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, nargs="+", default=list(range(1, 9)), help="class sizes n")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="victim draws per class")
    p.add_argument("--classes", type=int, nargs="+", help="victim classes (default: the few-shot ones)")
    p.add_argument("--pool", type=int, default=24, help="held-out images per class the victims come from")
    p.add_argument("--restarts", type=int, default=RESTARTS, help="starting rotations per inversion")
    p.add_argument("--release", choices=RELEASES, default="secagg", help="the sums' precision")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "audit.toml", help="the audit grid")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, help="write the settings, every trial and the table as JSON here")
    return p.parse_args(argv)


def problems(args: argparse.Namespace) -> list[str]:
    found = []
    if min(args.records) < 1 or max(args.records) > args.pool:
        found.append(f"--records must lie in 1..--pool ({args.pool}), got {args.records}")
    if args.restarts < 1 or args.threads < 1:
        found.append("--restarts and --threads must be at least 1")
    return found


class Setting:
    """The audit's scenario cut into the victims' pools and the attacker's own data, with the encoder,
    CCVR's method and state for the closing round, the secure sum's codec and the decoder."""

    def __init__(self, args: argparse.Namespace) -> None:
        config = load_audit_config(args.config)
        scenario = build_scenario(config, echo=lambda line: print(line, flush=True))
        self.seed = config.seed
        self.model = Audit(scenario).model
        self.ccvr = method_for(scenario, "ccvr")
        self.state = attacked_state(self.ccvr, scenario.state)
        self.schema = self.ccvr.schema(self.state)
        self.codec = FixedPointCodec(self.schema, max_silos=len(scenario.federation.silos))
        self.release = args.release
        few = ShotThresholds().groups(scenario.federation.train_counts)["few"]
        self.classes = args.classes if args.classes is not None else few
        self.train_counts = [int(c) for c in scenario.federation.train_counts]
        self.pools, self.attacker = _pools(scenario.public, self.classes, args.pool, config.seed)
        print(f"training the decoder on the attacker's {len(self.attacker)} images", flush=True)
        self.decoder = train_decoder(self.model, self.attacker, seed=config.seed)
        self.images = scenario.public
        self.priors = {label: self._prior(label) for label in self.classes}

    def released(self, victims: LabeledData, label: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Σz, Σzzᵀ (packed) and the count of `victims`' class as the aggregator reads them."""
        ctx = SiloContext(self.state.round + 1, "silo-0", self.seed)
        values = self.ccvr.local_round(self.state, victims, ctx).values
        if self.release == "secagg":
            flat = self.codec.decode(self.codec.encode(self.schema.flatten(values)))
            values = self.schema.unflatten(flat)
        return values["feature_sum"][label], values["outer_sum"][label], float(values["count"][label])

    def _prior(self, label: int) -> tuple[torch.Tensor, np.ndarray]:
        """The attacker's guess without a release: its own data's mean feature of the class (1, d), and
        the audit's prior image, that feature decoded."""
        own = self.attacker.x[self.attacker.y == label]
        return self.features(own).mean(dim=0, keepdim=True), prior(
            self.decoder, self.model, self.attacker, label
        )

    def features(self, images: np.ndarray) -> torch.Tensor:
        """The features a silo computes, clipped as CCVR's silos clip them."""
        bound = self.ccvr.options.feature_bound
        return extract_features(self.model, torch.from_numpy(images)).double().clamp(-bound, bound)


def _pools(
    public: LabeledData, classes: list[int], size: int, seed: int
) -> tuple[dict[int, np.ndarray], LabeledData]:
    """`size` held-out images of each victim class (indices into `public`), and the rest: the attacker's."""
    rng = np.random.default_rng(seed)
    pools = {}
    for label in classes:
        members = np.flatnonzero(public.y == label)
        if len(members) < size + MIN_ATTACKER_IMAGES:
            raise ValueError(
                f"class {label} has {len(members)} held-out images; a pool of {size} needs "
                f"{size + MIN_ATTACKER_IMAGES} (the attacker keeps {MIN_ATTACKER_IMAGES}): lower --pool"
            )
        pools[label] = rng.choice(members, size, replace=False)
    kept = np.setdiff1d(np.arange(len(public)), np.concatenate(list(pools.values())))
    return pools, public.subset(kept)


def trial(setting: Setting, label: int, n: int, seed: int, restarts: int) -> dict:
    """One class of n victims: what the attack, the prior and the mean give of them."""
    rng = np.random.default_rng([seed, label, n])
    victims = setting.images.subset(rng.choice(setting.pools[label], n, replace=False))
    truth = setting.features(victims.x)
    feature_sum, outer_sum, count = setting.released(victims, label)
    began = time.perf_counter()
    found = invert_moments(feature_sum, outer_sum, count, restarts=restarts, seed=seed)
    seconds = time.perf_counter() - began
    guess, prior_image = setting.priors[label]
    mean = (feature_sum.double() / max(round(count), 1))[None]
    errors = {
        name: record_errors(f, truth) for name, f in (("attack", found), ("prior", guess), ("mean", mean))
    }
    paired, drawn = best_match(victims.x, decode(setting.decoder, found))
    ssim = {
        "attack": per_image(paired, drawn)["ssim"],
        "prior": per_image(victims.x, np.repeat(prior_image, n, axis=0))["ssim"],
        "mean": per_image(victims.x, np.repeat(decode(setting.decoder, mean), n, axis=0))["ssim"],
        "ceiling": per_image(victims.x, decode(setting.decoder, truth))["ssim"],
    }
    return {
        "class": label,
        "records": n,
        "seed": seed,
        "released_count": count,
        "seconds": seconds,
        **{f"{name}_best_error": float(e.min()) for name, e in errors.items()},
        **{f"{name}_worst_error": float(e.max()) for name, e in errors.items()},
        **{f"{name}_best_ssim": float(s.max()) for name, s in ssim.items()},
    }


SUMMARISED = (
    "attack_best_error",
    "attack_worst_error",
    "prior_best_error",
    "mean_best_error",
    "attack_best_ssim",
    "prior_best_ssim",
    "mean_best_ssim",
    "ceiling_best_ssim",
    "seconds",
)


def summary(trials: list[dict], records: list[int]) -> dict[int, dict]:
    """Per n: the median and the range over trials of each score."""
    table = {}
    for n in records:
        rows = [t for t in trials if t["records"] == n]
        table[n] = {
            key: {
                "median": statistics.median(r[key] for r in rows),
                "min": min(r[key] for r in rows),
                "max": max(r[key] for r in rows),
            }
            for key in SUMMARISED
        }
        table[n]["trials"] = len(rows)
    return table


def floor_by_criterion(table: dict[int, dict]) -> int | None:
    """The smallest n whose median best-record error is no lower than the prior's; None if none is."""
    for n in sorted(table):
        if table[n]["attack_best_error"]["median"] >= table[n]["prior_best_error"]["median"]:
            return n
    return None


def markdown(table: dict[int, dict]) -> str:
    def spread(row: dict, key: str, digits: int) -> str:
        s = row[key]
        return f"{s['median']:.{digits}g} ({s['min']:.{digits}g}–{s['max']:.{digits}g})"

    lines = [
        "| n | trials | attack: best record's error | attack: worst record's error | prior: best error "
        "| mean only: best error | SSIM attack / prior / mean / ceiling (best record) | s per inversion |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, row in table.items():
        ssim = " / ".join(
            f"{row[k]['median']:.2f}"
            for k in ("attack_best_ssim", "prior_best_ssim", "mean_best_ssim", "ceiling_best_ssim")
        )
        lines.append(
            f"| {n} | {row['trials']} | {spread(row, 'attack_best_error', 2)} "
            f"| {spread(row, 'attack_worst_error', 2)} | {spread(row, 'prior_best_error', 2)} "
            f"| {spread(row, 'mean_best_error', 2)} | {ssim} | {row['seconds']['median']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found = problems(args)
    if found:
        print("error: " + "; ".join(found), file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        setting = Setting(args)
    except (FedltError, ValueError) as exc:  # a grid that does not load, classes the split cannot serve
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trials = []
    for n in args.records:
        for label in setting.classes:
            for seed in args.seeds:
                trials.append(trial(setting, label, n, seed, args.restarts))
        done = [t for t in trials if t["records"] == n]
        best = statistics.median(t["attack_best_error"] for t in done)
        print(f"n = {n}: median best-record error {best:.2g} over {len(done)} trials", flush=True)
    table = summary(trials, args.records)
    floor = floor_by_criterion(table)
    command = " ".join(["python benchmarks/record_floor.py", *sys.argv[1:]] if argv is None else argv)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} thread(s)"
    )
    verdict = f"r_min by the criterion: {floor}"
    if floor is None:
        verdict = f"r_min by the criterion: none up to n = {max(args.records)} (the moments beat the prior)"
    print(f"\n{markdown(table)}\n")
    print(
        f"classes {setting.classes} (training records {[setting.train_counts[c] for c in setting.classes]}), "
        f"seeds {args.seeds}, release {args.release}, {args.restarts} restart(s)\n{verdict}\n"
        f"{machine}; {time.perf_counter() - started:.0f} s\ncommand: {command}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": command,
            "machine": machine,
            "settings": {
                "config": str(args.config),
                "classes": setting.classes,
                "train_counts": setting.train_counts,
                "seeds": args.seeds,
                "pool": args.pool,
                "restarts": args.restarts,
                "release": args.release,
            },
            "r_min_by_criterion": floor,
            "summary": table,
            "trials": trials,
        }
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
