"""Distributed noise on released statistics: each silo's Skellam share (`privacy.dp.release`), the ledger
it is charged to (`SiloPrivacy.noised`), the multiplier picked from the plan, and the round driver that adds
it, up to the attack it exists to stop: a class one silo holds with one record, whose class sum is the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema, make_layer
from fedlt.aggregation.halves import SumSpec
from fedlt.dp import DPSettings
from fedlt.methods import ModelSpec, TrainConfig
from fedlt.methods.ccvr import CCVR, CCVROptions
from fedlt.methods.creff import CReFF, CReFFOptions
from fedlt.methods.heads import clip_features
from privacy.ckks.settings import CkksSettings
from privacy.dp.accountant import ORDERS, epsilon, gaussian_rdp, orders
from privacy.dp.ledger import Budget, BudgetExceeded, PrivacyLedger
from privacy.dp.noise import SecureRandom
from privacy.dp.release import FieldNoise, add_shares, grid_bits, noised_fields, release_rdp
from privacy.dp.silo_privacy import SiloPrivacy
from privacy.dp.skellam import l2_to_l1, skellam_rdp
from privacy.secagg.settings import SecAggSettings

SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)
DELTA = 1e-5
ALPHA = orders()
INTEGER = np.round(ALPHA) == ALPHA

# three noised fields of different sensitivities and precisions (g = 17, 12, and 8: capped by frac_bits), and
# one that is no statistic of records
MIXED = Schema(
    (
        Field("feat", (6, 500), 1e4, per_class=True, sensitivity=0.5),
        Field("outer", (3000,), 1e6, frac_bits=16, sensitivity=25.0),
        Field("coarse", (3000,), 1e3, frac_bits=8, sensitivity=0.01),
        Field("n", (5,), 1e3, frac_bits=0),
    )
)


@dataclass
class Plan:
    """What SiloPrivacy reads of a method: its rounds and the statistics it releases, in how many rounds."""

    fields: tuple[Field, ...]
    releases: int = 1
    rounds: int = 1

    def statistics_plan(self) -> tuple[tuple[Field, ...], int]:
        return self.fields, self.releases


def _settings(**overrides) -> DPSettings:
    return DPSettings(**({"enabled": True, "epsilon": 4.0, "delta": DELTA} | overrides))


def _silo(
    plan, settings: DPSettings | None = None, *, seed: object = 0, budget: Budget | None = None
) -> SiloPrivacy:
    settings = settings or _settings()
    ledger = PrivacyLedger(budget or Budget(settings.epsilon, settings.delta))
    return SiloPrivacy(settings, method=plan, ledger=ledger, rng=SecureRandom.seeded(seed))


def _spec(schema: Schema, silos: int = 3, round_id: str = "r1") -> SumSpec:
    return SumSpec(round_id, "contribution", tuple(f"silo-{i}" for i in range(silos)), schema)


def _parts(schema: Schema, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: value.reshape(-1) for name, value in schema.unflatten(vector).items()}


# ---------------------------------------------------------------- one silo's share: grids and scales


@st.composite
def _schemas(draw) -> Schema:
    fields, classes = [], draw(st.integers(1, 3))
    for i in range(draw(st.integers(1, 4))):
        noised = draw(st.booleans())
        sensitivity = draw(st.floats(1e-3, 1e3)) if noised else 0.0
        fields.append(
            Field(
                f"f{i}",
                (classes, draw(st.integers(1, 5))),
                100.0,
                frac_bits=draw(st.integers(0, 30)),
                per_class=draw(st.booleans()),
                sensitivity=sensitivity,
            )
        )
    return Schema(tuple(fields))


@given(schema=_schemas(), seed=st.integers(0, 1000), multiplier=st.floats(0.1, 10.0))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_shares_leave_unnoised_fields_alone_and_put_noised_ones_on_their_grid(schema, seed, multiplier):
    """Guards against shares touching unnoised fields, or noised values off their field's 2^-g grid."""
    generator = torch.Generator().manual_seed(seed)
    vector = (torch.rand(schema.size, generator=generator, dtype=torch.float64) - 0.5) * 200
    kept = vector.clone()
    out = add_shares(
        schema, vector, multiplier=multiplier, counted=2, participants=3, rng=SecureRandom.seeded(seed)
    )
    assert out.dtype == torch.float64
    given_parts, out_parts = _parts(schema, vector), _parts(schema, out)
    for f in schema.fields:
        if f.sensitivity == 0:
            assert torch.equal(out_parts[f.name], given_parts[f.name]), f.name
            continue
        g = grid_bits(f)
        units = out_parts[f.name] * 2.0**g
        assert torch.equal(units, torch.round(units)), f.name
        assert g <= f.frac_bits
        assert g == f.frac_bits or 2**16 <= f.sensitivity * 2.0**g < 2**17
    assert torch.equal(vector, kept)  # the caller's vector is not modified


def _summed_noise(schema: Schema, multiplier: float, n: int, t: int, tag: str) -> list[torch.Tensor]:
    """Running sums of the shares of silos 1..n on a zero vector: entry k − 1 is what k silos add."""
    zero = torch.zeros(schema.size, dtype=torch.float64)
    total, sums = zero, []
    for silo in range(n):
        rng = SecureRandom.seeded(f"{tag}/{n}/{t}/{silo}")
        total = total + add_shares(schema, zero, multiplier=multiplier, counted=t, participants=n, rng=rng)
        sums.append(total)
    return sums


@pytest.mark.parametrize(("n", "t"), [(2, 1), (3, 2), (4, 4), (5, 3)])
def test_any_t_shares_reach_the_target_noise_and_more_survivors_add_to_it(n, t):
    """Guards share calibration: k of n silos give k/t · (m·Δ)² per coordinate, per field (within 10%)."""
    multiplier = 1.5
    sums = _summed_noise(MIXED, multiplier, n, t, "variance")
    for k in range(t, n + 1):
        parts = _parts(MIXED, sums[k - 1])
        assert torch.equal(parts["n"], torch.zeros(5))
        for f in MIXED.fields[:3]:
            target = (multiplier * f.sensitivity) ** 2 * k / t
            variance = float(parts[f.name].var())
            assert variance == pytest.approx(target, rel=0.1), (f.name, k)
            assert float(parts[f.name].mean()) == pytest.approx(0.0, abs=4 * math.sqrt(target / f.size))


def test_shares_differ_between_silos_and_seeds():
    """Guards against silos drawing one common share (n² the variance) or noise not from their own stream."""
    zero = torch.zeros(MIXED.size, dtype=torch.float64)

    def share(seed: str) -> torch.Tensor:
        return add_shares(
            MIXED, zero, multiplier=1.0, counted=3, participants=3, rng=SecureRandom.seeded(seed)
        )

    a, b = share("a"), share("b")
    assert torch.equal(share("a"), a)
    assert (a != b).float().mean() > 0.9


# ---------------------------------------------------------------- what a release costs


def test_release_rdp_is_the_sum_of_each_noised_fields_skellam_bound():
    """Guards release_rdp: the sum over noised fields of the Skellam bound for one record's rounded row."""
    multiplier = 1.7
    expected = np.zeros(len(ORDERS))
    for f in MIXED.fields[:3]:
        g = grid_bits(f)
        units = f.sensitivity * 2.0**g
        d = f.row_size
        noise = FieldNoise.of(f, multiplier)
        assert noise.bits == g
        assert units + math.sqrt(d) / 2 <= noise.l2 <= units + math.sqrt(d) + 1e-9
        assert noise.l1 == pytest.approx(l2_to_l1(noise.l2, d))
        assert noise.variance == pytest.approx((multiplier * units) ** 2)
        expected += skellam_rdp(l1=noise.l1, l2=noise.l2, variance=(multiplier * units) ** 2)
    np.testing.assert_allclose(release_rdp(MIXED.fields, multiplier), expected, rtol=1e-12)
    assert MIXED.fields[0].row_size == 500  # one class row, not the 3000 values of the field
    assert [n.field.name for n in noised_fields(MIXED.fields, multiplier)] == ["feat", "outer", "coarse"]
    assert np.all(release_rdp(MIXED.fields[3:], multiplier) == 0)


@pytest.mark.parametrize("multiplier", [0.8, 2.0, 6.0])
def test_release_rdp_approaches_the_gaussian_of_its_fields(multiplier):
    """Guards the scale of the accounting: F noised fields at m cost about, never less than, α·F/(2m²)."""
    fields = MIXED.fields[:2]
    rdp = release_rdp(fields, multiplier)
    gaussian = ALPHA * len(fields) / (2 * multiplier**2)
    assert np.all(rdp[INTEGER] >= gaussian[INTEGER])
    np.testing.assert_allclose(rdp[INTEGER], gaussian[INTEGER], rtol=0.02)
    composed = epsilon(len(fields) * gaussian_rdp(noise_multiplier=multiplier), DELTA)
    assert epsilon(rdp, DELTA) == pytest.approx(composed, rel=0.05)
    assert epsilon(rdp, DELTA) >= composed


def test_the_rounded_sensitivity_covers_one_record_in_a_rounded_sum():
    """Guards the charged sensitivity against one record moving a silo's rounded sum by ‖x‖ + √d units."""
    sensitivity = (2**16 + 0.06) / 2**16  # g = 16: Δ = 65536.06 grid units
    f = Field("s", (4,), 1e3, sensitivity=sensitivity)
    schema = Schema((f,))
    grid = 2.0 ** grid_bits(f)
    others = torch.full((4,), 0.49 / grid, dtype=torch.float64)  # the silo's other records, summed
    record = torch.full((4,), 32768.02 / grid, dtype=torch.float64)
    assert float(record.norm()) <= sensitivity  # a record within the sensitivity

    def rounded(vector: torch.Tensor) -> torch.Tensor:
        """What add_shares makes of the silo's sum before its noise (multiplier 0: no noise)."""
        out = add_shares(
            schema, vector, multiplier=0.0, counted=1, participants=1, rng=SecureRandom.seeded(0)
        )
        return out * grid

    moved = float((rounded(others + record) - rounded(others)).norm())
    assert moved == pytest.approx(65538.0)
    assert moved <= FieldNoise.of(f, 1.0).l2


# ---------------------------------------------------------------- SiloPrivacy.noised: the ledger first


def test_noised_charges_the_release_once_per_call_then_adds_the_share():
    """Guards noised: one ledger entry per call (skellam, fields, RDP), then noise on noised fields only."""
    silo = _silo(Plan(MIXED.fields), _settings(epsilon=1e4, statistics_noise=3.0))  # no refusal here
    vector = torch.ones(MIXED.size, dtype=torch.float64)
    out = silo.noised(_spec(MIXED), vector, counted=2)
    (entry,) = silo.ledger.entries
    assert entry["mechanism"] == "skellam"
    assert entry["params"]["fields"] == ["feat", "outer", "coarse"]
    assert entry["params"]["counted"] == 2
    assert entry["params"]["silos"] == 3
    assert entry["params"]["noise"] == 3.0
    assert "r1" in entry["what"]
    np.testing.assert_allclose(entry["rdp"], release_rdp(MIXED.fields, 3.0), rtol=1e-12)
    parts, before = _parts(MIXED, out), _parts(MIXED, vector)
    assert torch.equal(parts["n"], before["n"])
    assert all((parts[name] != before[name]).any() for name in ("feat", "outer", "coarse"))

    silo.noised(_spec(MIXED, round_id="r2"), vector, counted=3)
    assert len(silo.ledger.entries) == 2
    np.testing.assert_allclose(silo.ledger.spent_rdp(), 2 * release_rdp(MIXED.fields, 3.0), rtol=1e-12)


def test_noised_refuses_a_release_past_the_budget_and_draws_no_noise():
    """Guards the refusal: BudgetExceeded, nothing recorded, nothing drawn from the silo's stream."""
    silo = _silo(Plan(MIXED.fields), _settings(epsilon=1.0, statistics_noise=0.5), seed="refuse")
    twin = SecureRandom.seeded("refuse")
    with pytest.raises(BudgetExceeded, match="statistics of r1"):
        silo.noised(_spec(MIXED), torch.ones(MIXED.size, dtype=torch.float64), counted=3)
    assert silo.ledger.entries == []
    assert np.array_equal(silo.rng.words(8), twin.words(8))


def test_noised_passes_a_schema_without_sensitivities_through_uncharged():
    """Guards against charging or noising a contribution with no statistic of records (FedAvg's)."""
    schema = Schema((Field("delta", (6,), 10.0), Field("n", (), 1e3, frac_bits=0)))
    silo = _silo(Plan(MIXED.fields), _settings(statistics_noise=2.0), seed="none")
    vector = torch.arange(7, dtype=torch.float64) / 3
    out = silo.noised(_spec(schema), vector, counted=3)
    assert torch.equal(out, torch.arange(7, dtype=torch.float64) / 3)
    assert silo.ledger.entries == []
    assert np.array_equal(silo.rng.words(4), SecureRandom.seeded("none").words(4))


# ---------------------------------------------------------------- the multiplier, from the plan alone


def _methods(rounds: int = 3) -> dict[str, object]:
    dp = _settings()
    return {
        "creff": CReFF(options=CReFFOptions(), train=TrainConfig(), model=SPEC, rounds=rounds, dp=dp),
        "ccvr": CCVR(options=CCVROptions(), train=TrainConfig(), model=SPEC, rounds=rounds, dp=dp),
    }


@pytest.mark.parametrize("name", ["creff", "ccvr"])
def test_auto_statistics_noise_is_the_plans_and_fits_half_of_its_epsilon(name):
    """Guards the auto multiplier: one per plan, not per budget or data; counts + releases just fit ε/2."""
    method = _methods()[name]
    fields, releases = method.statistics_plan()
    assert releases == (3 if name == "creff" else 1)
    assert noised_fields(fields, 1.0)
    silos = [
        _silo(method, seed=0),
        _silo(method, seed=1, budget=Budget(1.0, DELTA)),
        _silo(method, seed=2, budget=Budget(100.0, DELTA)),
    ]
    spender = _silo(method, seed=3)
    spender.reported_counts(np.array([40, 3, 0, 12]))  # data, and a ledger that has spent
    silos.append(spender)
    multiplier = silos[0].statistics_noise
    assert multiplier > 0
    assert [s.statistics_noise for s in silos] == [multiplier] * len(silos)

    counts = gaussian_rdp(noise_multiplier=_settings().count_noise)

    def planned(m: float) -> float:
        return epsilon(counts + releases * release_rdp(fields, m), DELTA)

    assert planned(multiplier) <= 4.0 / 2
    assert planned(0.99 * multiplier) > 4.0 / 2


def test_auto_statistics_noise_grows_with_the_releases_and_a_set_value_is_kept():
    """Guards that the auto multiplier follows the planned releases and a set statistics_noise is kept."""
    few, many = _methods(rounds=1)["creff"], _methods(rounds=6)["creff"]
    assert _silo(many).statistics_noise > _silo(few).statistics_noise
    assert _silo(many, _settings(statistics_noise=1.25)).statistics_noise == 1.25


# ---------------------------------------------------------------- the attack the noise stops

CLASSES, DIM, NORM = 4, 16, 5.0
FEATURES = Schema((Field("feature_sum", (CLASSES, DIM), 1e4, per_class=True, sensitivity=NORM),))


def _feature_sums(seed: int = 0) -> tuple[list, torch.Tensor]:
    """Three silos' per-class feature sums (features clipped to NORM): classes 0–2 held by the first two
    silos with many records each; class 3 held only by silo-2, with one record. Returns the contributions and
    that record."""
    generator = torch.Generator().manual_seed(seed)
    contributions = []
    for silo in range(3):
        labels = torch.randint(0, 3, (40,), generator=generator) if silo < 2 else torch.tensor([0, 1, 3])
        z = clip_features(3 * torch.randn(len(labels), DIM, generator=generator, dtype=torch.float64), NORM)
        sums = torch.zeros(CLASSES, DIM, dtype=torch.float64).index_add_(0, labels, z)
        contributions.append(FEATURES.contribution(feature_sum=sums))
        if silo == 2:
            record = z[2]
    return contributions, record


def _singleton_guess(sums) -> torch.Tensor:
    """The aggregator's attack: the class only one record has is that record's feature vector."""
    return sums["feature_sum"][3]


def test_without_dp_the_sum_of_a_singleton_class_is_its_record_and_with_dp_it_is_lost_in_noise():
    """Guards against the singleton attack: in the clear a lone record's class sum is it; under DP, noise."""
    contributions, record = _feature_sums()
    assert float(record.norm()) == pytest.approx(NORM)  # the record was clipped
    silos = ["silo-0", "silo-1", "silo-2"]
    plain = make_layer("plaintext").aggregate(FEATURES, contributions, silos=silos)
    # to float32's precision, in which plaintext uploads carry the feature sums
    torch.testing.assert_close(_singleton_guess(plain), record, rtol=1e-6, atol=0)

    noise = {u: _silo(Plan(FEATURES.fields), seed=f"attack/{u}") for u in silos}
    private = make_layer("plaintext").aggregate(FEATURES, contributions, silos=silos, noise=noise)
    error = float((_singleton_guess(private) - record).norm())
    assert error > 3 * NORM
    # the noise is the calibrated one: its expected norm is m·Δ·√d, and every silo paid for its share
    multiplier = noise["silo-0"].statistics_noise
    assert 0.5 * multiplier * NORM * math.sqrt(DIM) < error < 2 * multiplier * NORM * math.sqrt(DIM)
    assert all(len(p.ledger.entries) == 1 for p in noise.values())


# ---------------------------------------------------------------- the round driver under DP, over secagg

HOLDINGS = [(0, 1, 2), (0, 1), (0, 3)]  # silo -> classes it holds: classes 2 and 3 by one silo each
ROUND = Schema(
    (
        Field("w", (3,), 10.0, frac_bits=20),
        Field("grad", (CLASSES, 8), 1e4, per_class=True, sensitivity=1.0),
        Field("count", (CLASSES,), 1e3, frac_bits=0, per_class=True),
    )
)


def _round_contributions() -> list:
    generator = torch.Generator().manual_seed(5)
    out = []
    for held in HOLDINGS:
        mask = torch.zeros(CLASSES, dtype=torch.float64)
        mask[list(held)] = 1.0
        grad = (torch.rand(CLASSES, 8, generator=generator, dtype=torch.float64) + 0.5) * mask[:, None]
        w = torch.randn(3, generator=generator, dtype=torch.float64)
        out.append(ROUND.contribution(w=w, grad=grad, count=7.0 * mask))
    return out


def _dp_round(layer, tag: str):
    silos = ["a", "b", "c"]
    noise = {u: _silo(Plan(ROUND.fields), _settings(statistics_noise=2.0), seed=f"{tag}/{u}") for u in silos}
    sums = layer.aggregate(ROUND, _round_contributions(), silos=silos, noise=noise)
    plain = make_layer("plaintext").aggregate(ROUND, _round_contributions(), silos=silos)
    return noise, sums, plain


def _assert_noised(noise, sums, plain, *, counted: int) -> None:
    """Every silo charged one release with shares for `counted` silos; the noised field carries the target
    noise times √(n / counted); the unnoised model field is exact to its grid."""
    for p in noise.values():
        (entry,) = p.ledger.entries
        assert entry["params"]["counted"] == counted
    scale = 2.0 * math.sqrt(3 / counted)
    residual = (sums["grad"] - plain["grad"]).flatten()
    assert 0.5 * scale < float(residual.std()) < 1.6 * scale
    assert float((sums["w"] - plain["w"]).abs().max()) <= 3 * 2.0**-20


def test_under_dp_the_census_says_nothing_and_the_sum_carries_the_noise():
    """Guards the secagg round under DP: census all 3s, nothing zeroed, shares for all 3, noise on the sum."""
    layer = make_layer("secagg", SecAggSettings(threshold=2))
    noise, sums, plain = _dp_round(layer, "census")
    assert layer.censuses[ROUND.phase].counts == (3, 3, 3, 3)
    assert layer.zeroed == []
    assert sums.contributors == 3
    _assert_noised(noise, sums, plain, counted=3)
    assert torch.equal(sums["count"], plain["count"])


def test_without_the_guard_the_shares_are_calibrated_for_the_threshold():
    """Guards calibration without the tail guard: shares for t = 2 of 3 silos (3/2 the target at the sum)."""
    layer = make_layer("secagg", SecAggSettings(threshold=2, k_min=0))
    noise, sums, plain = _dp_round(layer, "threshold")
    assert ROUND.phase not in layer.censuses
    _assert_noised(noise, sums, plain, counted=2)


def test_the_same_round_without_dp_shows_the_holdings_and_guards_the_rare_classes():
    """Guards the contrast: without DP the census shows true holdings and the guard zeroes rare classes."""
    layer = make_layer("secagg", SecAggSettings(threshold=2))
    records = {u: 7 * np.isin(np.arange(CLASSES), held) for u, held in zip("abc", HOLDINGS, strict=True)}
    layer.aggregate(ROUND, _round_contributions(), silos=["a", "b", "c"], records=records)
    assert layer.censuses[ROUND.phase].counts == (3, 2, 1, 1)
    assert layer.zeroed == [2, 3]


def test_the_ckks_layer_carries_the_same_noise_from_before_encryption():
    """Guards the CKKS path under DP: every silo's share goes in before encryption, calibrated for the whole
    census set (per-class rows go out only in a sum over all of it), and the decrypted sum carries it."""
    _assert_noised(*_dp_round(make_layer("ckks"), "ckks"), counted=3)


def test_without_the_guard_ckks_shares_are_calibrated_for_the_floor_not_every_listed_silo():
    """Finding 4: CKKS has no dropout recovery, and shares calibrated for every listed silo left a sum after
    a dropout (or with ghost ids listed) short of its noise; they are calibrated for the fewest silos the
    release gate lets a sum count (the simulator's floor, two), and a sum below it is refused."""
    _assert_noised(*_dp_round(make_layer("ckks", CkksSettings(k_min=0)), "ckks-floor"), counted=2)
