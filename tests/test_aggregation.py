import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema, SumLayer, Sums, layer_names, make_layer
from fedlt.aggregation.halves import SumSpec
from fedlt.aggregation.plaintext import (
    PlaintextAggregatorHalf,
    PlaintextSum,
    Upload,
    from_wire,
    to_wire,
    upload_bytes,
)
from fedlt.errors import ConfigError, ContributionError

SCHEMA = Schema((Field("delta", (3,), 5.0), Field("n", (), 100.0)))


def test_contribution_is_checked_and_clipped():
    c = SCHEMA.contribution(delta=torch.tensor([1.0, -7.0, 9.0]), n=4)
    assert c.values["delta"].tolist() == [1.0, -5.0, 5.0]
    assert c.clipped == 2
    assert c.values["delta"].dtype == torch.float64
    assert c.flat().tolist() == [1.0, -5.0, 5.0, 4.0]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"delta": torch.zeros(3)}, "missing field 'n'"),
        ({"delta": torch.zeros(3), "n": 1, "extra": 1}, "unknown field 'extra'"),
        ({"delta": torch.zeros(4), "n": 1}, r"shape \(4,\), schema says \(3,\)"),
        ({"delta": torch.tensor([0.0, float("nan"), float("inf")]), "n": 1}, "2 non-finite values"),
    ],
)
def test_contribution_refuses_what_the_schema_does_not_allow(values, message):
    with pytest.raises(ContributionError, match=message):
        SCHEMA.contribution(**values)


def test_schema_refuses_duplicates_and_bad_bounds():
    with pytest.raises(ValueError, match="duplicate field 'a'"):
        Schema((Field("a", (1,), 1.0), Field("a", (2,), 1.0)))
    with pytest.raises(ValueError, match="finite bound > 0"):
        Schema((Field("a", (1,), float("inf")),))


def test_sums_cannot_be_made_outside_a_privacy_layer():
    with pytest.raises(TypeError, match="only by a privacy layer"):
        Sums(SCHEMA, torch.zeros(4), 1)


@given(st.lists(st.lists(st.floats(-5, 5), min_size=4, max_size=4), min_size=1, max_size=8))
@settings(max_examples=50, deadline=None)
def test_plaintext_sum_is_the_sum(rows):
    contributions = [SCHEMA.contribution(delta=torch.tensor(r[:3]), n=abs(r[3])) for r in rows]
    sums = PlaintextSum().aggregate(SCHEMA, contributions)
    total = torch.stack([c.flat() for c in contributions]).sum(0)
    assert torch.allclose(SCHEMA.flatten(sums), total)
    assert sums.contributors == len(rows)


def test_plaintext_refuses_empty_and_foreign_rounds():
    layer = PlaintextSum()
    with pytest.raises(ContributionError, match="no contributions"):
        layer.aggregate(SCHEMA, [])
    other = Schema((Field("delta", (3,), 5.0), Field("n", (), 100.0)), phase="stats")
    with pytest.raises(ContributionError, match=r"contributions \[1\] were built for another schema"):
        layer.aggregate(
            SCHEMA,
            [SCHEMA.contribution(delta=torch.zeros(3), n=1), other.contribution(delta=torch.zeros(3), n=1)],
        )


def test_plaintext_says_loudly_what_it_is(caplog):
    with caplog.at_level(logging.WARNING, logger="fedlt.aggregation.plaintext"):
        make_layer("plaintext")
    assert "in the clear" in caplog.text


def test_layer_table():
    assert isinstance(make_layer("plaintext"), SumLayer)
    installed = r"installed: blind, ckks, plaintext"
    with pytest.raises(ConfigError, match=rf"unknown privacy layer 'rot13'; {installed}"):
        make_layer("rot13")
    assert set(layer_names()) >= {"plaintext"}


def test_unflatten_round_trip_and_shape_check():
    vec = torch.arange(4, dtype=torch.float64)
    parts = SCHEMA.unflatten(vec)
    assert parts["delta"].tolist() == [0.0, 1.0, 2.0]
    assert parts["n"].shape == ()
    with pytest.raises(ContributionError, match=r"schema needs \(4,\)"):
        SCHEMA.unflatten(torch.zeros(5))


WIRE = Schema(
    (
        Field("delta", (4,), 10.0),  # float32
        Field("second_moment", (2,), 1e6, float64=True),  # asks for float64
        Field("count", (), 2.0**30, frac_bits=0),  # integers past float32's exact range: float64
        Field("small_count", (), 1000.0, frac_bits=0),  # exact in float32
    )
)


def test_a_plaintext_upload_is_float32_except_where_a_field_needs_float64():
    assert [f.wire_dtype for f in WIRE.fields] == ["<f4", "<f8", "<f8", "<f4"]
    assert upload_bytes(WIRE) == 4 * 4 + 2 * 8 + 8 + 4
    vector = torch.tensor(
        [0.1, -0.2, 1e-9, 3.0, 123456.789012345, -1e-12, 2.0**30 - 1, 999.0], dtype=torch.float64
    )
    back = from_wire(WIRE, to_wire(WIRE, vector))
    assert torch.equal(back[:4], vector[:4].float().double())  # rounded to float32, as the model is
    assert torch.equal(back[4:], vector[4:])  # float64 fields, and counts, exactly
    with pytest.raises(ContributionError, match="the schema needs 44"):
        from_wire(WIRE, to_wire(WIRE, vector)[:-4])


def test_the_simulators_plaintext_sum_is_of_the_uploaded_bytes():
    """In-process halves exchange the same bytes as the consortium: the sum is of float32-rounded deltas."""
    rows = [torch.tensor([0.1, 0.2, 0.3, 0.4, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64) for _ in range(2)]
    sums = PlaintextSum().aggregate(WIRE, [WIRE.contribution(**WIRE.unflatten(r)) for r in rows])
    assert torch.equal(sums["delta"], 2 * rows[0][:4].float().double())
    assert float(sums["second_moment"][0]) == 2.0


def test_the_aggregator_clips_a_plaintext_upload_beyond_its_bounds():
    """A silo that skips its method's clipping cannot move the sum further than the bounds allow."""
    spec = SumSpec("r1.a1", "contribution", ("silo-0", "silo-1"), WIRE)
    half = PlaintextAggregatorHalf(spec)
    honest = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.float64)
    beyond = torch.tensor([1e6, 0, 0, 0, 0, 0, 0, 1], dtype=torch.float64)
    half.receive("silo-0", Upload(to_wire(WIRE, honest)))
    half.receive("silo-1", Upload(to_wire(WIRE, beyond)))
    assert float(half.close().total[0]) == 1.0 + 10.0  # the delta's bound
