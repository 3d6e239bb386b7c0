"""The one screen report.md leads with, for a privacy officer to sign: each mode's strongest attack beside
what the same attack reaches when the view gives it everything (its calibration row) and the baselines it must
beat, then the empirical ε of the silos' DP-SGD beside the ledger's, then the attacks run once per model.

A calibration row is a finding of a mode named "reference: …": the attack on the fullest view there is (one
record's own gradient; a record's true feature). An attack that reaches its calibration where the view is
full and the prior where the layer protects shows both that the attack is strong and that the layer works.
"""

from __future__ import annotations

from attacks.audit import EPSILON, Finding
from attacks.config import AuditConfig

REFERENCE = "reference"
GRADIENT = "gradinv"  # calibrated by the one-record gradient row; every other image attack by true features


def render_summary(config: AuditConfig, findings: list[Finding]) -> list[str]:
    """The summary's lines (markdown): empty where the grid ran none of what it summarises."""
    lines = _image_table(config, findings) + _epsilon_table(findings) + _once_lines(findings)
    return ["## Summary", "", *lines] if lines else []


def _image_table(config: AuditConfig, findings: list[Finding]) -> list[str]:
    images = [f for f in findings if "ssim" in f.metrics]
    references = [f for f in images if f.mode.startswith(REFERENCE)]
    rows = []
    for mode in config.modes:
        attacked = [f for f in images if f.mode == mode.name]
        if not attacked:
            continue
        strongest = max(attacked, key=lambda f: (f.leaked, gain(f)))  # a leak by feature error shows too
        calibration = _calibration(strongest, references)
        m = strongest.metrics
        calibrated = "—" if calibration is None else f"{calibration.metrics['ssim']:.2f}"
        verdict = ("**LEAK**" if mode.audited else "leak (shown for contrast)") if strongest.leaked else "no"
        withheld = " (withheld: prior)" if strongest.note.startswith(("withheld", "refused")) else ""
        rows.append(
            f"| {mode.name}{'' if mode.audited else ' (contrast)'} | {strongest.attack}{withheld} — "
            f"{strongest.party} | {m['ssim']:.2f} ({gain(strongest):+.2f}) | "
            f"{calibrated} | {m['ssim_prior']:.2f} | "
            f"{m['ssim_random']:.2f} | {verdict} |"
        )
    if not rows:
        return []
    return [
        "Per mode, the attack that drew closest to the records (median SSIM, its gain over the better "
        "baseline), beside the same attack's calibration row (the fullest view: one record's own gradient, "
        "or a record's true feature) and the baselines: the attacker's prior (what it draws with no "
        "release) and random images.",
        "",
        "| mode | strongest attack — party | SSIM (gain) | calibration | prior | random | leak |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(
            [
                "Calibration rows (median SSIM): "
                + "; ".join(
                    f"{f.attack}, {f.target.split(':')[0]}: {f.metrics['ssim']:.2f}" for f in references
                )
                + ".",
                "",
            ]
            if references
            else []
        ),
    ]


def gain(f: Finding) -> float:
    m = f.metrics
    return m["ssim"] - max(m["ssim_random"], m["ssim_prior"])


def _calibration(finding: Finding, references: list[Finding]) -> Finding | None:
    """The reference row of `finding`'s attack: the gradient one for gradient inversion, else the true
    feature of the same class (any class's where that one has none)."""
    family = [f for f in references if f.attack.startswith(GRADIENT) == finding.attack.startswith(GRADIENT)]
    target = finding.target.split(":")[0]
    same = [f for f in family if f.target.split(":")[0] == target]
    return max(same or family, key=lambda f: f.metrics["ssim"], default=None)


def _epsilon_table(findings: list[Finding]) -> list[str]:
    audits = [f for f in findings if f.attack == EPSILON]
    if not audits:
        return []
    rows = []
    for f in audits:
        m = f.metrics
        if m.get("control"):
            charged = "none (noise off)"
            verdict = "**short of its ceiling: FAILED**" if f.leaked else "at its ceiling: the audit sees"
        else:
            charged = f"{m['epsilon_charged']:.2f}"
            verdict = "**above the charge: FAILED**" if f.leaked else "within the charge"
            if m["epsilon_charged"] >= m["ceiling"]:
                verdict += " (the charge is above the ceiling: this row cannot fail)"
        rows.append(
            f"| {f.mode} | {charged} | {m['epsilon_lower_bound']:.2f} | "
            f"{int(m['correct'])} of {int(m['guesses'])} | {m['ceiling']:.2f} | {verdict} |"
        )
    return [
        "Empirical ε of a silo's DP-SGD (one training run with canaries, 95% confidence): a lower bound "
        "on the ε the run really has, beside the ε its ledger charged; the control, with the noise switched "
        "off, shows how high the audit can see (its ceiling, set by the number of canaries).",
        "",
        "| run | ε charged | ε lower bound | correct guesses | ceiling | verdict |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _once_lines(findings: list[Finding]) -> list[str]:
    """One line per attack run once (presence, membership, protocol): its audited findings' worst, and how
    many of its contrast rows (the naive designs) leak."""
    once = [f for f in findings if "ssim" not in f.metrics and f.attack != EPSILON]
    families = list(dict.fromkeys(f.attack.split(":")[0] for f in once))
    lines = []
    for family in families:
        group = [f for f in once if f.attack.split(":")[0] == family]
        audited = [f for f in group if f.audited]
        contrast = [f for f in group if not f.audited]
        leaks = [f for f in audited if f.leaked]
        said = f"**{len(leaks)} leak(s)**" if leaks else "no leak"
        said = (
            f"{said} in {len(audited)} audited finding(s)"
            if audited
            else "no audited finding (contrast only)"
        )
        lines.append(
            f"- **{family}**: {said}; the contrast designs leak in {sum(f.leaked for f in contrast)} of "
            f"{len(contrast)}."
        )
    return [*lines, ""] if lines else []
