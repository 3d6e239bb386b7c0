"""Known answers and properties of the secure-aggregation primitives: mask PRG, Shamir, fixed-point codec."""

from __future__ import annotations

import itertools
import secrets

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema
from privacy.secagg import shamir
from privacy.secagg.codec import FixedPointCodec, OverflowRisk
from privacy.secagg.prg import mask


def test_mask_known_answer_rfc8439_zero_key():
    # RFC 8439 Appendix A.1, test vector 1: key and nonce all zero, block counter 0.
    expected = bytes.fromhex("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7")
    assert mask(bytes(32), 4).tobytes() == expected


def test_mask_is_a_function_of_the_whole_seed():
    seed = secrets.token_bytes(32)
    assert np.array_equal(mask(seed, 1000), mask(seed, 1000))
    assert np.array_equal(mask(seed, 10), mask(seed, 1000)[:10])
    flipped = seed[:31] + bytes([seed[31] ^ 1])
    assert not np.array_equal(mask(seed, 100), mask(flipped, 100))  # the last byte matters too
    with pytest.raises(ValueError, match="32 bytes"):
        mask(seed[:16], 4)


def test_mask_words_look_uniform():
    words = mask(secrets.token_bytes(32), 200_000)
    top_bytes = (words >> np.uint64(56)).astype(np.int64)
    counts = np.bincount(top_bytes, minlength=256)
    chi2 = float(((counts - len(words) / 256) ** 2 / (len(words) / 256)).sum())
    assert chi2 < 340  # 255 degrees of freedom: P(chi2 > 340) < 0.001 for uniform bytes


def test_shamir_known_answer_with_fixed_polynomial():
    # f(x) = 5 + 3x + 2x^2 over the field: shares at 1, 2, 3 are 10, 19, 32
    assert shamir._evaluate([5, 3, 2], 1) == 10
    assert shamir._evaluate([5, 3, 2], 3) == 32
    secret = shamir.combine({1: 10, 2: 19, 3: 32}, threshold=3)
    assert int.from_bytes(secret, "big") == 5


@given(
    shares=st.integers(1, 8),
    data=st.data(),
)
@settings(max_examples=40, deadline=None)
def test_shamir_any_threshold_subset_rebuilds_the_secret(shares, data):
    threshold = data.draw(st.integers(1, shares))
    secret = data.draw(st.binary(min_size=32, max_size=32))
    parts = shamir.split(secret, shares=shares, threshold=threshold)
    for subset in itertools.combinations(parts, threshold):
        assert shamir.combine({x: parts[x] for x in subset}, threshold=threshold) == secret


def test_shamir_refuses_too_few_and_detects_tampering():
    secret = secrets.token_bytes(32)
    parts = shamir.split(secret, shares=5, threshold=3)
    with pytest.raises(shamir.ShamirError, match="2 shares cannot rebuild"):
        shamir.combine({1: parts[1], 2: parts[2]}, threshold=3)
    # a corrupted share moves the rebuilt value to a random-looking field element, almost surely >= 2^256
    tampered = {1: parts[1], 2: parts[2], 3: (parts[3] + 2**300) % shamir.PRIME}
    with pytest.raises(shamir.ShamirError, match="inconsistent or tampered"):
        shamir.combine(tampered, threshold=3)


def schema_at(frac_bits: int) -> Schema:
    return Schema(
        (Field("delta", (6,), 4.0, frac_bits=frac_bits), Field("n", (), 1000.0, frac_bits=frac_bits))
    )


@given(
    rows=st.lists(st.lists(st.floats(-10, 10), min_size=7, max_size=7), min_size=1, max_size=10),
    frac_bits=st.integers(8, 24),
)
@settings(max_examples=60, deadline=None)
def test_codec_sums_within_the_bound(rows, frac_bits):
    codec = FixedPointCodec(schema_at(frac_bits), max_silos=10)
    vectors = [torch.tensor(r, dtype=torch.float64) for r in rows]
    total = np.zeros(codec.schema.size, dtype=np.uint64)
    for v in vectors:
        total += codec.encode(v)  # uint64 wraps around, as masked sums do
    clipped = [torch.clamp(v, -torch.tensor(codec.bounds), torch.tensor(codec.bounds)) for v in vectors]
    error = (codec.decode(total) - torch.stack(clipped).sum(0)).abs().max().item()
    assert error <= len(rows) * 2.0**-frac_bits


def test_codec_refuses_a_round_that_could_overflow():
    with pytest.raises(OverflowRisk, match="could overflow 64 bits in n"):
        FixedPointCodec(schema_at(52), max_silos=100)
    FixedPointCodec(schema_at(40), max_silos=100)  # 100 · 1000 · 2^40 < 2^63


def test_codec_refuses_wrong_shapes_and_non_finite_values():
    codec = FixedPointCodec(schema_at(16), max_silos=2)
    with pytest.raises(ValueError, match="schema needs"):
        codec.encode(torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(torch.tensor([float("nan")] * 7))


def test_shamir_catches_a_corrupted_share_beyond_the_threshold():
    secret = secrets.token_bytes(32)
    parts = shamir.split(secret, shares=5, threshold=3)
    parts[5] = (parts[5] + 1) % shamir.PRIME  # the first three alone would still rebuild the secret
    with pytest.raises(shamir.ShamirError, match="inconsistent or tampered"):
        shamir.combine(parts, threshold=3)
    del parts[5]
    assert shamir.combine(parts, threshold=3) == secret
