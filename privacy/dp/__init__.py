"""Differential privacy for a silo's records.

    noise.py         SecureRandom: uniforms, Gaussians, Poisson, Skellam draws from an AES-256-CTR keystream
    accountant.py    Rényi DP over one list of orders: DP-SGD (Opacus' analysis), Gaussian; ε from a curve
    skellam.py       the distributed Skellam mechanism: RDP bound, shares calibrated for t of n silos
    release.py       a silo's share of noise on the statistics fields of a sum, and the release's RDP
    ledger.py        PrivacyLedger: every mechanism run, charged before it runs, refused past the budget
    silo_privacy.py  SiloPrivacy: the one object a silo's training and sums use, over all of the above

DP-SGD itself (one-pass per-record clipping on Opacus' per-layer rules, noise as Opacus' DPOptimizer adds it)
is in `fedlt.methods.dpsgd` and `fedlt.methods.clipping`, at the one door to training.
"""

from privacy.dp.ledger import Budget, BudgetExceeded, LedgerError, PrivacyLedger
from privacy.dp.silo_privacy import SiloPrivacy

__all__ = ["Budget", "BudgetExceeded", "LedgerError", "PrivacyLedger", "SiloPrivacy"]
