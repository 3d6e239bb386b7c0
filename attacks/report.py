"""The audit's report folder: report.json (every finding and score), report.md (the table a privacy officer
reads), one PNG grid per image attack (originals beside what each mode let the attacker draw), and the
one-screen console summary.

The verdict is one of three: FAILED (a leak crossed a threshold in an audited mode), PASSED, or NOTHING
AUDITED where no attack ran at all, so that zero findings never read as zero leaks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attacks.audit import EPSILON, Finding
from attacks.config import AuditConfig
from attacks.summary import REFERENCE, render_summary
from fedlt.atomic import atomic_write_text

HEADLINE = {  # the score each attack's row shows, and how to read it
    "analytic": ("feature_error", "relative error of the recovered feature"),
    "moments": ("feature_error", "relative error of the recovered features"),
    "presence": ("best_detector_within_class_auc", "ROC-AUC of telling a silo's classes, within a class"),
    "membership": ("tpr_at_0.1%_fpr", "TPR at 0.1% FPR"),
    EPSILON: ("epsilon_lower_bound", "ε lower bound at 95%"),
    "protocol": ("recovered", "what the attack recovered (1: all)"),
    "protocol: presence intersection": ("bits_beyond_census", "presence bits beyond the census counts"),
}


PASSED, FAILED, NOTHING_AUDITED = "PASSED", "FAILED", "NOTHING AUDITED"
EXIT_CODES = {PASSED: 0, FAILED: 1, NOTHING_AUDITED: 3}  # `python -m attacks.evaluate`; 2: a usage error


@dataclass(frozen=True)
class Subject:
    """What a deployment audit attacked, in place of the grid's data: `header`, the report's sentence on the
    consortium and its store; `nothing_applies`, why no attack applies to it (shown only when none ran);
    `facts`, the same for report.json."""

    header: str
    nothing_applies: str
    facts: dict


def verdict(findings: list[Finding]) -> str:
    """No finding is no check, so its own verdict: "0 findings" must not read as "no leak"."""
    if not findings:
        return NOTHING_AUDITED
    return FAILED if any(f.leaked and f.audited for f in findings) else PASSED


def verdict_line(findings: list[Finding], subject: Subject | None, report: Path) -> str:
    """The console's last line: the verdict, and for NOTHING AUDITED why."""
    said = verdict(findings)
    if said == FAILED:
        return f"audit FAILED: a leak crossed a threshold in an audited mode; report: {report}"
    if said == NOTHING_AUDITED:
        return f"audit {NOTHING_AUDITED} — {_nothing(subject)}; report: {report}"
    return f"audit passed; report: {report}"


def write_report(
    out: Path, config: AuditConfig, findings: list[Finding], seconds: float, *, subject: Subject | None = None
) -> dict:
    """`subject`: a deployment's store was audited, not the grid's scenario; report.json then records its
    facts and the thresholds, not the grid's settings."""
    out.mkdir(parents=True, exist_ok=True)
    grids = _plot_grids(out, findings)
    said = verdict(findings)
    audited = (
        {"config": dataclasses.asdict(config)}
        if subject is None
        else {"deployment": subject.facts, "thresholds": dataclasses.asdict(config.thresholds)}
    )
    summary = {
        "verdict": said.lower(),
        "passed": said == PASSED,
        "seconds": round(seconds, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **audited,
        "findings": [_as_json(f) for f in findings],
        "grids": grids,
    }
    atomic_write_text(out / "report.json", json.dumps(_plain(summary), indent=1, allow_nan=False))
    atomic_write_text(out / "report.md", render_markdown(config, findings, grids, seconds, subject=subject))
    return summary


def render_markdown(
    config: AuditConfig,
    findings: list[Finding],
    grids: list[str],
    seconds: float,
    *,
    subject: Subject | None = None,
) -> str:
    failed = [f for f in findings if f.leaked and f.audited]
    said = verdict(findings)
    data = (
        f"Data: {config.data.dataset}, IF {config.data.imbalance:g}, α {config.data.alpha:g}, "
        f"{config.data.silos} silos, seed {config.seed}."
        if subject is None
        else subject.header
    )
    thresholds = config.thresholds
    lines = [f"# Privacy audit: {said}", ""]
    if said == NOTHING_AUDITED:
        why = _nothing(subject)
        lines += [f"{why[0].upper()}{why[1:]}.", ""]
    lines += [
        f"{len(findings)} findings in {seconds / 60:.1f} min; {len(failed)} leak(s) in audited modes. {data} "
        f"Thresholds: SSIM over the best baseline > {thresholds.ssim_over_random}, feature error < "
        f"{thresholds.feature_error}, presence AUC > {thresholds.presence_auc}, membership TPR at 0.1% FPR > "
        f"{thresholds.membership_tpr}.",
    ]
    if not findings:
        return "\n".join(lines) + "\n"  # no tables of nothing
    lines += ["", *render_summary(config, findings)]
    if any("ssim" in f.metrics for f in findings):
        lines += [
            "## Every image and feature attack",
            "",
            "Image scores are medians over the attacked records (SSIM, PSNR in dB) beside two baselines: "
            "random images, and the attacker's prior (its own data's class prototype, decoded; for gradient "
            "inversion, as many of its own images). *withheld*: the mode released "
            "nothing for the target, so the attacker is left with its prior.",
            "",
            "SSIM of what the attacker drew (its gain over the better baseline), and the recovered feature's "
            "relative error; **bold**: a leak.",
            "",
            render_matrix(findings),
            "",
        ]
    lines += [
        "## Every finding",
        "",
        "| attack | mode | party | target | SSIM (random / prior) | PSNR | score | leak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in findings:
        m = f.metrics
        ssim = f"{m['ssim']:.3f} ({m['ssim_random']:.3f} / {m['ssim_prior']:.3f})" if "ssim" in m else "—"
        psnr = f"{m['psnr']:.1f}" if "psnr" in m else "—"
        leak = ("**LEAK**" if f.audited else "leak (not audited)") if f.leaked else "no"
        if f.mode.startswith(REFERENCE):
            leak = "calibration"
        note = f" — {f.note}" if f.note else ""
        lines.append(
            f"| {f.attack} | {f.mode} | {f.party} | {f.target}{note} | {ssim} | {psnr} | {_headline(f)} | "
            f"{leak} |"
        )
    if grids:
        lines += ["", "## Reconstructions", ""]
        lines += [f"![{Path(g).stem}]({g})" for g in grids]
    return "\n".join(lines) + "\n"


def _nothing(subject: Subject | None) -> str:
    """Why no attack ran."""
    if subject is None:
        return "the grid's attacks and modes gave no finding (see --attacks and --modes)"
    return f"no attack applies to what this store holds: {subject.nothing_applies}"


def render_matrix(findings: list[Finding]) -> str:
    """Attacks × modes of the image and feature attacks: the median SSIM over the better baseline's (or the
    recovered feature's error), with the leaks in bold; the attacks run once are listed under it."""
    per_mode = [f for f in findings if "ssim" in f.metrics and not f.mode.startswith(REFERENCE)]
    columns = _columns(per_mode)
    rows = list(dict.fromkeys((f.attack, f.target.split(":")[0]) for f in per_mode))
    header = "| attack | target | " + " | ".join(columns.values()) + " |"
    lines = [header, "|---|---|" + "---|" * len(columns)]
    for attack, target in rows:
        cells = []
        for column in columns:
            f = next(
                (
                    f
                    for f in per_mode
                    if (f.attack, f.target.split(":")[0], (f.mode, f.party)) == (attack, target, column)
                ),
                None,
            )
            cells.append("—" if f is None else _cell(f))
        lines.append(f"| {attack} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _columns(findings: list[Finding]) -> dict[tuple[str, str], str]:
    """The columns of a table of findings, by (mode, party): a mode's name, and the party too where the
    mode's findings attack several parties' views (blind: the aggregator alone, and with one silo)."""
    keys = list(dict.fromkeys((f.mode, f.party) for f in findings))
    parties = Counter(mode for mode, _ in keys)
    return {(mode, party): mode if parties[mode] == 1 else f"{mode} · {party}" for mode, party in keys}


def _cell(f: Finding) -> str:
    m = f.metrics
    gain = m["ssim"] - max(m["ssim_random"], m["ssim_prior"])
    text = f"SSIM {m['ssim']:.2f} ({gain:+.2f})"
    if "feature_error" in m:
        error = m["feature_error"]
        text += ", error " + ("withheld" if math.isinf(error) else f"{error:.1e}")
    return f"**{text}**" if f.leaked else text


def console_summary(findings: list[Finding]) -> str:
    width = max((len(f.attack) for f in findings), default=10)
    modes = max((len(f.mode) for f in findings), default=10)
    rows = []
    for f in findings:
        flag = ("LEAK" if f.audited else "leak") if f.leaked else "ok"
        ssim = f"SSIM {f.metrics['ssim']:.2f}" if "ssim" in f.metrics else ""
        rows.append(f"  {flag:5} {f.attack:<{width}}  {f.mode:<{modes}}  {_headline(f):<28} {ssim}")
    return "\n".join(rows)


def _headline(f: Finding) -> str:
    key, what = HEADLINE.get(f.attack) or HEADLINE.get(f.attack.split(":")[0], ("", ""))
    if key in f.metrics:
        value = f.metrics[key]
        return f"{what}: {'∞' if math.isinf(value) else f'{value:.3g}'}"
    return "—"


def _plot_grids(out: Path, findings: list[Finding]) -> list[str]:
    """One PNG per attack: a row per target, the original then each mode's reconstruction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_attack: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.images:
            by_attack[f.attack].append(f)
    written = []
    for attack, group in by_attack.items():
        targets = list(dict.fromkeys(f.target for f in group))
        columns = _columns(group)
        fig, axes = plt.subplots(
            len(targets),
            len(columns) + 1,
            figsize=(1.6 * (len(columns) + 1), 1.8 * len(targets)),
            squeeze=False,
        )
        for row, target in enumerate(targets):
            cells = {(f.mode, f.party): f for f in group if f.target == target}
            first = next(iter(cells.values()))
            _show(axes[row, 0], first.images["original"][0], "original" if row == 0 else "")
            axes[row, 0].set_ylabel(target.split(":")[0], fontsize=7)
            for col, (column, label) in enumerate(columns.items(), start=1):
                f = cells.get(column)
                title = label if row == 0 else ""
                if f is None:
                    axes[row, col].axis("off")
                    continue
                _show(axes[row, col], f.images["recovered"][0], title)
                withheld = "withheld: prior, " if f.note.startswith("withheld") else ""
                axes[row, col].set_xlabel(f"{withheld}SSIM {f.metrics['ssim']:.2f}", fontsize=7)
        fig.suptitle(attack, fontsize=9)
        fig.tight_layout()
        name = f"grid-{attack.split(':')[0].replace(' ', '-')}" + (
            "-" + attack.split(": ")[1].split()[0].lower() if ": " in attack else ""
        )
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        written.append(f"{name}.png")
    return written


def _show(ax, image: np.ndarray, title: str) -> None:
    picture = np.clip(np.moveaxis(image, 0, -1), 0, 1)
    ax.imshow(picture.squeeze(-1) if picture.shape[-1] == 1 else picture, cmap="gray", vmin=0, vmax=1)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:  # a mode and party can be long: wrapped, so that neighbouring columns' titles stay apart
        ax.set_title(textwrap.fill(title, 22), fontsize=6)


def _as_json(f: Finding) -> dict:
    return {
        "attack": f.attack,
        "mode": f.mode,
        "party": f.party,
        "target": f.target,
        "metrics": f.metrics,
        "leaked": f.leaked,
        "audited": f.audited,
        "note": f.note,
    }


def _plain(value):
    """JSON's own values: non-finite floats become null (∞ is 'nothing recovered', NaN 'not defined'; the
    finding's note says which), numpy scalars and tuples their Python forms."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
