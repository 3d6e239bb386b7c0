"""The one screen report.md leads with: each mode's strongest attack beside its calibration row and the
baselines, the empirical ε beside the ledger's, and the attacks run once."""

from attacks.audit import Finding
from attacks.config import AuditConfig, Mode
from attacks.summary import render_summary

PLAIN = Mode(name="plaintext", privacy="plaintext", audited=False)
GUARD = Mode(name="secagg + tail guard", privacy="secagg", k_min=2)
CONFIG = AuditConfig(modes=(PLAIN, GUARD))


def image(attack: str, mode: str, ssim: float, *, prior: float = 0.2, leaked: bool = False, target="class 9"):
    metrics = {"ssim": ssim, "ssim_random": 0.01, "ssim_prior": prior, "psnr": 10.0, "mae": 0.1}
    return Finding(attack, mode, "aggregator", f"{target}: one record", metrics, leaked, mode != "plaintext")


def test_each_mode_names_its_strongest_attack_with_that_attacks_calibration_and_baselines():
    findings = [
        image("gradinv: one record's gradient", "reference: one record's gradient", 0.93, target="4 records"),
        image("feature inversion: true feature", "reference: true features", 0.85),
        image("analytic", "plaintext", 0.85, leaked=True),
        image("gradinv", "plaintext", 0.40, prior=0.43, target="silo-0"),
        image("analytic", "secagg + tail guard", 0.2),
        image("gradinv", "secagg + tail guard", 0.31, prior=0.43, target="silo-0"),
    ]
    text = "\n".join(render_summary(CONFIG, findings))
    assert text.startswith("## Summary")
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # the header row off
    plain, guard = rows
    assert plain.startswith("| plaintext (contrast) | analytic — aggregator | 0.85 (+0.65) | 0.85 | 0.20 |")
    assert "leak (shown for contrast)" in plain
    # under the guard both attacks are at or below the prior: the stronger gain is analytic's 0.00
    assert guard.startswith("| secagg + tail guard | analytic — aggregator | 0.20 (+0.00) | 0.85 |")
    assert guard.endswith("| no |")
    assert (
        "Calibration rows (median SSIM): gradinv: one record's gradient, 4 records: 0.93; "
        "feature inversion: true feature, class 9: 0.85." in text
    )


def test_the_empirical_epsilon_table_flags_a_bound_above_the_charge_and_a_control_without_power():
    def run(mode: str, bound: float, charged: float, *, control: bool = False, leaked: bool) -> Finding:
        metrics = {
            "epsilon_lower_bound": bound,
            "epsilon_charged": charged,
            "correct": 90.0,
            "guesses": 100.0,
            "ceiling": 5.82,
            "control": float(control),
        }
        return Finding("empirical ε", mode, "a silo's DP-SGD", "canaries", metrics, leaked, True)

    findings = [
        run("dp ε=1", 0.3, 0.92, leaked=False),
        run("dp ε=4", 4.3, 3.98, leaked=True),
        run("dp ε=8", 1.4, 7.98, leaked=False),
        run("control: noise off", 5.82, float("inf"), control=True, leaked=False),
        run("control: noise off", 2.0, float("inf"), control=True, leaked=True),
    ]
    lines = render_summary(CONFIG, findings)
    assert "| dp ε=1 | 0.92 | 0.30 | 90 of 100 | 5.82 | within the charge |" in lines
    assert "| dp ε=4 | 3.98 | 4.30 | 90 of 100 | 5.82 | **above the charge: FAILED** |" in lines
    assert (
        "| dp ε=8 | 7.98 | 1.40 | 90 of 100 | 5.82 | within the charge (the charge is above the ceiling: "
        "this row cannot fail) |"
    ) in lines
    assert (
        "| control: noise off | none (noise off) | 5.82 | 90 of 100 | 5.82 | at its ceiling: the audit sees |"
        in lines
    )
    assert (
        "| control: noise off | none (noise off) | 2.00 | 90 of 100 | 5.82 | "
        "**short of its ceiling: FAILED** |" in lines
    )


def test_attacks_run_once_are_one_line_each_counting_audited_leaks_and_contrast_rows():
    protocol = [
        Finding(
            "protocol: two attempts", "silo release gate", "aggregator", "v", {"recovered": 0.0}, False, True
        ),
        Finding("protocol: two attempts", "no ledger", "aggregator", "v", {"recovered": 1.0}, True, False),
        Finding("membership: LiRA", "final model", "anyone", "m", {"tpr_at_0.1%_fpr": 0.0}, False, True),
    ]
    lines = render_summary(CONFIG, protocol)
    assert "- **protocol**: no leak in 1 audited finding(s); the contrast designs leak in 1 of 1." in lines
    assert "- **membership**: no leak in 1 audited finding(s); the contrast designs leak in 0 of 0." in lines


def test_nothing_to_summarise_gives_no_section():
    assert render_summary(CONFIG, []) == []
