"""Privacy audits: attacks on exactly what each party of a consortium sees, scored, and a report
(`python -m attacks.evaluate`, docs/AUDIT.md).

    evaluate.py         the command: the grid, a progress bar, the report, the exit code
    config.py           the grid (configs/audit.toml): data, training, modes, attacks, thresholds
    scenario.py         the federation with planted small classes, the model, each mode's uploads and sums
    audit.py            every attack on every mode's view, as findings against baselines and thresholds
    analytic.py         (a) a feature from a per-class linear-layer gradient
    moments.py          (b) the records of a class from Σz, Σzzᵀ and its count (non-negative ICA for n ≥ 3)
    decoder.py          (c) a decoder trained on public data, from features to images
    gradinv.py          (d) Inverting Gradients on a model delta, sized for CPU
    presence.py         (e) class presence against MFSC's disclosure, beside the census
    membership.py       (f) loss threshold and offline LiRA on the final model
    protocol.py         (g) a malicious aggregator against the real silo code
    aggregator_data.py  what a real aggregator stored, attacked (`--aggregator-data`)
    scoring.py          SSIM/PSNR/MAE per image against baselines; ROC-AUC and TPR at low FPR
    report.py           report.md, report.json, PNG grids and the console summary
"""
