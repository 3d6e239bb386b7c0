"""What a person reads or looks at after a run: the accuracy table and two plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from fedlt.metrics import GROUPS


def percent(value: float | None) -> str:
    return "   n/a" if value is None else f"{100 * value:5.1f}%"


def accuracy_table(
    final: dict, classes: Sequence[str], train_counts: Sequence[int] | None, rules: dict[str, str]
) -> str:
    counts = ["?"] * len(classes) if train_counts is None else [str(int(n)) for n in train_counts]
    lines = [
        f"{'overall':<10} {percent(final['accuracy'])}",
        *(f"{g:<10} {percent(final[g])}   ({rules[g]})" for g in GROUPS),
        "",
        f"{'class':<10} {'train n':>8} {'accuracy':>9}",
        *(
            f"{name:<10} {n:>8} {percent(acc):>9}"
            for name, n, acc in zip(classes, counts, final["per_class"], strict=True)
        ),
    ]
    return "\n".join(lines)


def comparison_table(
    finals: Mapping[str, dict], classes: Sequence[str], train_counts: Sequence[int], rules: dict[str, str]
) -> str:
    """Final accuracies of several runs side by side, per shot group and per class; with two runs the
    last column is the second's gain over the first, in points."""
    names = list(finals)
    gain = len(names) == 2
    header = f"{'':<10} {'train n':>8} " + " ".join(f"{n:>9}" for n in names) + (" gain" if gain else "")

    def row(label: str, count: str, values: list[float | None]) -> str:
        line = f"{label:<10} {count:>8} " + " ".join(f"{percent(v):>9}" for v in values)
        if gain and None not in values:
            line += f" {100 * (values[1] - values[0]):+5.1f}"
        return line

    lines = [header, row("overall", "", [finals[n]["accuracy"] for n in names])]
    lines += [row(g, "", [finals[n][g] for n in names]) + f"   ({rules[g]})" for g in GROUPS]
    lines.append("")
    lines += [
        row(name, str(int(count)), [finals[n]["per_class"][c] for n in names])
        for c, (name, count) in enumerate(zip(classes, train_counts, strict=True))
    ]
    return "\n".join(lines)


def plot_comparison(
    finals: Mapping[str, dict], classes: Sequence[str], train_counts: Sequence[int], path: Path, title: str
) -> None:
    """Per-class accuracy of several runs as grouped bars, classes in order of their training counts."""
    fig = Figure(figsize=(max(6, 0.8 * len(classes)), 4.2))
    ax = fig.subplots()
    width = 0.8 / len(finals)
    for k, (name, final) in enumerate(finals.items()):
        xs = [c + (k - (len(finals) - 1) / 2) * width for c in range(len(classes))]
        ax.bar(
            xs,
            [_pct(v) for v in final["per_class"]],
            width,
            label=f"{name} ({percent(final['accuracy']).strip()})",
        )
    labels = [f"{name}\nn={int(n)}" for name, n in zip(classes, train_counts, strict=True)]
    ax.set_xticks(range(len(classes)), labels, fontsize=8)
    ax.set(xlabel="class (training samples)", ylabel="test accuracy (%)", ylim=(0, 112), title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    _save(fig, path)


def plot_curves(rounds: Sequence[dict], path: Path, title: str) -> None:
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    x = [r["round"] for r in rounds]
    for key, style in (("accuracy", "k-"), ("many", "C0--"), ("medium", "C1--"), ("few", "C3--")):
        y = [_pct(r[key]) for r in rounds]
        ax.plot(x, y, style, label="overall" if key == "accuracy" else f"{key}-shot", linewidth=1.8)
    ax.set(xlabel="round", ylabel="test accuracy (%)", ylim=(0, 100), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    _save(fig, path)


def plot_per_class(
    final: dict,
    classes: Sequence[str],
    train_counts: Sequence[int] | None,
    groups: dict[str, list[int]],
    path: Path,
    title: str,
) -> None:
    fig = Figure(figsize=(max(6, 0.6 * len(classes)), 4.2))
    ax = fig.subplots()
    grouped = [(g, c, groups[g]) for g, c in zip(GROUPS, ("C0", "C1", "C3"), strict=True) if groups[g]]
    for group, color, members in grouped or [("all", "C0", list(range(len(classes))))]:
        bars = ax.bar(
            members,
            [_pct(final["per_class"][c]) for c in members],
            color=color,
            label=f"{group}-shot" if grouped else None,
        )
        if train_counts is None:
            continue
        for bar, c in zip(bars, members, strict=True):
            ax.annotate(
                f"n={int(train_counts[c])}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(classes)), classes)
    xlabel = "class" if train_counts is None else "class (training samples above each bar)"
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)", ylim=(0, 112), title=title)
    ax.grid(axis="y", alpha=0.3)
    if grouped:
        ax.legend(loc="upper right", ncols=3, fontsize=8)
    _save(fig, path)


def _pct(value: float | None) -> float:
    return float("nan") if value is None else 100 * value


def _save(fig: Figure, path: Path) -> None:
    """Figures built without pyplot hold no global state, so nothing needs closing."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
