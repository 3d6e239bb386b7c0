"""The tail guard: a per-class sum over fewer than k_min silos is one silo's data and must never be released.

presence() feeds the census, held_back() reads it, zero_classes() applies it; the `secagg` layer chains them
before the secure sum. Each is checked here against an independent reading of the schema.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlt.aggregation import Contribution, Field, Schema, make_layer, tail_guard
from privacy.secagg.layer import SecAggSum
from privacy.secagg.settings import SecAggSettings

CLASSES = 5
SCHEMA = Schema(
    (
        Field("bias", (3,), 10.0, frac_bits=20),  # not per class: never counted, never zeroed
        Field("grad", (CLASSES, 2, 2), 10.0, frac_bits=20, per_class=True, inverts=True),
        Field("counts", (CLASSES,), 1000.0, frac_bits=0, per_class=True),
    )
)


def flat(**values: torch.Tensor) -> torch.Tensor:
    """A flat vector of SCHEMA, zero wherever `values` says nothing."""
    full = {f.name: torch.zeros(f.shape, dtype=torch.float64) for f in SCHEMA.fields}
    return SCHEMA.flatten(full | values)


def rows_of(name: str, vector: torch.Tensor) -> torch.Tensor:
    """Field `name` of a flat vector, one row per class."""
    return SCHEMA.unflatten(vector)[name].reshape(CLASSES, -1)


def test_presence_marks_a_class_with_any_non_zero_value_in_any_per_class_field():
    grad = torch.zeros(CLASSES, 2, 2, dtype=torch.float64)
    grad[1, 1, 0] = 1e-9  # one tiny value in one cell is enough
    grad[4, 0, 1] = -3.0  # negative values count
    counts = torch.zeros(CLASSES, dtype=torch.float64)
    counts[2] = 7.0  # marked by the other per-class field alone
    present = tail_guard.presence(SCHEMA, flat(grad=grad, counts=counts, bias=torch.ones(3)))
    assert present.dtype == np.uint64
    assert present.tolist() == [0, 1, 1, 0, 1]
    assert tail_guard.presence(SCHEMA, flat(bias=torch.ones(3))).tolist() == [0] * CLASSES


def test_presence_agrees_with_a_row_by_row_reading_on_random_sparse_contributions():
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        grad = torch.randn(CLASSES, 2, 2, generator=generator, dtype=torch.float64)
        grad *= torch.rand(CLASSES, 2, 2, generator=generator) < 0.1
        counts = torch.randint(0, 3, (CLASSES,), generator=generator).to(torch.float64)
        counts *= torch.rand(CLASSES, generator=generator) < 0.3
        expected = [int(grad[c].abs().sum() > 0 or counts[c] != 0) for c in range(CLASSES)]
        assert tail_guard.presence(SCHEMA, flat(grad=grad, counts=counts)).tolist() == expected


@pytest.mark.parametrize(
    ("k_min", "held"),
    [(0, []), (1, []), (2, [1]), (3, [1, 2]), (6, [1, 2, 3, 4])],
)
def test_held_back_names_the_classes_some_but_fewer_than_k_min_silos_hold(k_min, held):
    """A class nobody holds has nothing to hide; one held by exactly k_min silos is released."""
    counts = np.array([0, 1, 2, 3, 5], dtype=np.uint64)
    result = tail_guard.held_back(counts, k_min)
    assert result == held
    assert all(type(c) is int for c in result)


def test_zero_classes_zeroes_only_the_per_class_rows_of_the_named_classes():
    generator = torch.Generator().manual_seed(5)
    before = flat(
        bias=torch.randn(3, generator=generator, dtype=torch.float64) + 5,
        grad=torch.randn(CLASSES, 2, 2, generator=generator, dtype=torch.float64) + 5,
        counts=torch.arange(1, CLASSES + 1, dtype=torch.float64),
    )
    kept = before.clone()
    after = tail_guard.zero_classes(SCHEMA, before, [1, 3])
    assert torch.equal(before, kept)  # the caller's vector is left alone
    for name in ("grad", "counts"):
        assert rows_of(name, after)[[1, 3]].abs().sum() == 0
        assert torch.equal(rows_of(name, after)[[0, 2, 4]], rows_of(name, before)[[0, 2, 4]])
    assert torch.equal(SCHEMA.unflatten(after)["bias"], SCHEMA.unflatten(before)["bias"])
    assert torch.equal(tail_guard.zero_classes(SCHEMA, before, []), before)


# --- the layer ---------------------------------------------------------------------------------------------

# silo -> classes it holds; class 0 by all, 1 by two, 2 and 4 by one each, 3 by none
HOLDINGS = [(0, 1, 4), (0, 1), (0, 2)]


def contributions(holdings: list[tuple[int, ...]]) -> list[Contribution]:
    generator = torch.Generator().manual_seed(11)
    out = []
    for classes in holdings:
        held = torch.zeros(CLASSES, dtype=torch.float64)
        held[list(classes)] = 1.0
        grad = (torch.rand(CLASSES, 2, 2, generator=generator, dtype=torch.float64) + 0.5) * held.view(
            -1, 1, 1
        )
        bias = torch.randn(3, generator=generator, dtype=torch.float64)
        out.append(SCHEMA.contribution(bias=bias, grad=grad, counts=3.0 * held))
    return out


def records(holdings: list[tuple[int, ...]], silos=()) -> dict[str, np.ndarray]:
    """Each silo's record counts for the census's record floor: 3 of every class it holds (as `counts`)."""
    names = list(silos) or [f"silo-{i:04d}" for i in range(len(holdings))]
    return {
        u: np.bincount(np.repeat(list(h), 3), minlength=CLASSES) for u, h in zip(names, holdings, strict=True)
    }


def check_sums(layer: SecAggSum, held: list[int], holdings: list[tuple[int, ...]] = HOLDINGS) -> None:
    """The layer's sums: rows of `held` zero, everything else the plaintext sum within the codec bound."""
    given = contributions(holdings)
    sums = layer.aggregate(SCHEMA, given, records=records(holdings))
    plain = make_layer("plaintext").aggregate(SCHEMA, given)
    assert layer.zeroed == held
    assert sums.contributors == len(holdings)
    released = [c for c in range(CLASSES) if c not in held]
    for f in SCHEMA.fields:
        bound = len(holdings) * 2.0**-f.frac_bits
        if f.per_class:
            secure, truth = sums[f.name].reshape(CLASSES, -1), plain[f.name].reshape(CLASSES, -1)
            assert (truth[held].abs().sum(dim=1) > 0).all(), f.name  # there was something to hide
            assert secure[held].abs().sum() == 0, f.name
            assert (secure[released] - truth[released]).abs().max().item() <= bound, f.name
        else:  # the lone holders' other fields still count
            assert (sums[f.name] - plain[f.name]).abs().max().item() <= bound, f.name


def test_the_layer_releases_no_class_held_by_fewer_than_k_min_silos():
    check_sums(SecAggSum(), held=[2, 4])  # the default k_min is 2
    check_sums(SecAggSum(SecAggSettings(k_min=3)), held=[1, 2, 4])


def test_the_layer_releases_no_statistic_that_inverts_of_a_class_held_by_fewer_records_than_the_floor():
    """Finding 6: two silos with one record each pass k_min = 2, and a statistic that inverts (moments, a
    per-class gradient) of two records gives both away; the census's capped record counts hold such a class
    back in those fields, while its counts (which give no record away) still go out; a class held by enough
    records passes."""
    given = contributions(HOLDINGS)
    few = records(HOLDINGS)
    for silo in few.values():
        silo[1] = min(int(silo[1]), 1)  # class 1: one record at each of its two silos
    layer = SecAggSum(SecAggSettings(k_min=2, min_records=3))
    sums = layer.aggregate(SCHEMA, given, records=few)
    assert (layer.zeroed, layer.floored) == ([2, 4], [1])
    plain = make_layer("plaintext").aggregate(SCHEMA, given)
    assert sums["grad"].reshape(CLASSES, -1)[1].abs().sum() == 0
    assert float(sums["counts"][1]) == float(plain["counts"][1]) == 6.0
    open_floor = SecAggSum(SecAggSettings(k_min=2, min_records=2))
    open_floor.aggregate(SCHEMA, given, records=few)
    assert (open_floor.zeroed, open_floor.floored) == ([2, 4], [])  # two records reach a floor of two
    unknown = SecAggSum(SecAggSettings(min_records=3))  # silos that do not say how many they hold claim one
    unknown.aggregate(SCHEMA, given)
    assert (unknown.zeroed, unknown.floored) == ([2, 4], [1, 2, 4])  # 2 and 4: one silo, one record each
    assert SecAggSettings().min_records == tail_guard.ONLY_UNDER_DP  # by default: no floor, only DP


def test_a_silo_releases_statistics_that_invert_only_under_dp_unless_its_policy_accepts_a_floor():
    """Finding 6, measured (docs/BENCHMARKS.md, the record floor): second moments give a class's records back
    at any size up to 80, so by default a silo refuses a plan releasing them without DP; a floor it accepts
    knowingly must be met; counts and plain sums need nothing."""
    refusal = tail_guard.inverting_problems(SCHEMA, 0, dp=False, accepted=tail_guard.ONLY_UNDER_DP)
    assert len(refusal) == 1
    assert "grad without [dp]" in refusal[0]
    assert "only under DP" in refusal[0]
    assert tail_guard.inverting_problems(SCHEMA, 0, dp=True, accepted=0) == []
    assert (
        "below policy.min_class_records 3"
        in tail_guard.inverting_problems(SCHEMA, 2, dp=False, accepted=3)[0]
    )
    assert tail_guard.inverting_problems(SCHEMA, 3, dp=False, accepted=3) == []
    counts_only = Schema((Field("counts", (CLASSES,), 1000.0, frac_bits=0, per_class=True),))
    assert tail_guard.inverting_problems(counts_only, 0, dp=False, accepted=0) == []


@pytest.mark.parametrize("k_min", [0, 1])
def test_with_the_tail_guard_off_every_class_is_released(k_min):
    check_sums(SecAggSum(SecAggSettings(k_min=k_min)), held=[])


def check_zeroed(layer: SecAggSum, zeroed: list[int], holdings, silos=()) -> None:
    sums = layer.aggregate(SCHEMA, contributions(holdings), silos=silos, records=records(holdings, silos))
    assert layer.zeroed == zeroed
    rows = sums["grad"].reshape(CLASSES, -1)
    assert rows[zeroed].abs().sum() == 0
    assert all(
        rows[c].abs().sum() > 0 for c in range(CLASSES) if c not in zeroed and any(c in h for h in holdings)
    )


def test_the_census_is_taken_once_per_phase_and_per_class_rows_go_only_into_sums_over_its_silos():
    """Presence summed over changing silo sets could be solved for each silo's classes, so the first round
    of a phase fixes the census set; every later round sums over exactly it or zeroes every class."""
    layer = SecAggSum()
    three = ["h", "i", "j"]
    check_zeroed(layer, [2, 4], HOLDINGS, three)
    # the census stands for the phase: a later round over the same silos is guarded by it, not by new presence
    check_zeroed(layer, [2, 4], [(0, 1, 2, 3, 4)] * 3, three)
    # any other set of silos (a subset, a superset, other names) gets no per-class row at all
    check_zeroed(layer, list(range(CLASSES)), HOLDINGS[:2], three[:2])
    check_zeroed(layer, list(range(CLASSES)), [*HOLDINGS, (0,)], [*three, "k"])
    assert list(layer.censuses) == [SCHEMA.phase]
    # a resumed run carries the census over
    resumed = SecAggSum()
    resumed.restore(layer.saved())
    check_zeroed(resumed, [2, 4], [(0, 1, 2, 3, 4)] * 3, three)
    classless = Schema((Field("w", (4,), 1.0),))
    layer.aggregate(classless, [classless.contribution(w=torch.ones(4)) for _ in range(3)])
    assert layer.zeroed == []


def test_per_class_fields_must_share_one_class_axis():
    with pytest.raises(ValueError, match="per-class fields need a leading class axis of one common length"):
        Schema((Field("a", (4, 2), 1.0, per_class=True), Field("b", (5,), 1.0, per_class=True)))
    with pytest.raises(ValueError, match="leading class axis"):
        Schema((Field("scalar", (), 1.0, per_class=True),))
    assert (
        Schema((Field("a", (4, 2), 1.0, per_class=True), Field("b", (4,), 1.0, per_class=True))).classes == 4
    )
    assert SCHEMA.classes == CLASSES
