"""Known answers and properties of the secure-aggregation primitives: mask PRG, Shamir, fixed-point codec."""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregation import Field, Schema
from privacy.dp.noise import SecureRandom
from privacy.ring import (
    BLOCK_BYTES,
    ENCODE_BLOCK,
    KEY_ROW,
    MASK_KEYSTREAM,
    ROUNDING_KEY,
    FixedPointCodec,
    OverflowRisk,
    Ring,
    apply_masks,
    choose_encoding,
    keystream_bytes,
    mask,
    rounding_key,
)
from privacy.secagg import shamir


def test_chacha20_keystream_known_answer_rfc8439_zero_key():
    # RFC 8439 Appendix A.1, test vector 1: key and nonce all zero, block counter 0.
    expected = bytes.fromhex("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7")
    assert keystream_bytes(bytes(32), 32, "chacha20") == expected


# NIST SP 800-38A F.5.1, CTR-AES128.Encrypt: the seed is the key, then the initial counter block
AES_KEY, AES_COUNTER = (
    bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c"),
    bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"),
)
AES_PLAIN = bytes.fromhex(
    "6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51"
    "30c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710"
)
AES_CIPHER = bytes.fromhex(
    "874d6191b620e3261bef6864990db6ce9806f66b7970fdff8617187bb9fffdff"
    "5ae4df3edbd5d35e5b4f09020db03eab1e031dda2fbe03d1792170a0f3009cee"
)


def test_aes_128_ctr_keystream_known_answer_nist_sp800_38a():
    expected = bytes(p ^ c for p, c in zip(AES_PLAIN, AES_CIPHER, strict=True))
    assert keystream_bytes(AES_KEY + AES_COUNTER, 64, "aes-128-ctr") == expected
    assert MASK_KEYSTREAM == "aes-128-ctr"
    assert mask(AES_KEY + AES_COUNTER, 8).tobytes() == expected  # masks are that keystream's words


def test_masks_cover_a_mixed_ring_with_one_keystream_read_in_its_word_sizes():
    """Wide words take the first 8·wide bytes of the stream, narrow words the rest; adding a mask to zeros
    gives the stream's bytes, subtracting gives each word's negation at its own width."""
    seed, ring = secrets.token_bytes(32), Ring(wide=BLOCK_BYTES // 8 + 3, narrow=BLOCK_BYTES // 4 + 5)
    added, subtracted = ring.zeros(), ring.zeros()
    apply_masks(ring, added, [(seed, False)])
    apply_masks(ring, subtracted, [(seed, True)])
    assert added.tobytes() == keystream_bytes(seed, ring.nbytes)
    for plus, minus in zip(ring.parts(added), ring.parts(subtracted), strict=True):
        assert not np.any(plus + minus)


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


@pytest.mark.parametrize(
    ("bound", "frac_bits", "sensitivity", "silos", "expected"),
    [
        (10.0, 24, 0.0, 12, (32, 24, False)),  # 12 · 10 · 2^24 < 2^31: 32-bit words at the field's precision
        (10.0, 24, 0.0, 13, (32, 23, True)),  # one silo more: a bit of precision less, rounded stochastically
        (10.0, 24, 0.0, 51, (32, 22, True)),
        (10.0, 24, 0.0, 52, (32, 21, True)),
        (10.0, 24, 0.0, 3300, (64, 24, False)),  # 32-bit words would leave fewer than 16 fractional bits
        (
            10.0,
            24,
            1.0,
            13,
            (64, 24, False),
        ),  # a DP statistic keeps its precision: its noise is in those units
        (1e5, 0, 0.0, 21_474, (32, 0, False)),  # counts: exact in 32 bits while n · 10^5 < 2^31
        (1e5, 0, 0.0, 21_475, (64, 0, False)),
    ],
)
def test_each_field_gets_the_narrowest_words_that_hold_its_sum(
    bound, frac_bits, sensitivity, silos, expected
):
    field = Field("x", (3,), bound, frac_bits=frac_bits, sensitivity=sensitivity)
    encoding = choose_encoding(field, silos)
    assert (encoding.bits, encoding.frac_bits, encoding.stochastic) == expected


MIXED = Schema(
    (
        Field("delta", (5,), 10.0, frac_bits=24),  # narrow, lowered for more than 12 silos
        Field("stat", (3,), 1e9, frac_bits=20, sensitivity=1.0),  # wide
        Field("n", (), 1e5, frac_bits=0),  # narrow, exact
    )
)


@given(
    rows=st.lists(st.lists(st.floats(-1e10, 1e10), min_size=9, max_size=9), min_size=1, max_size=30),
    silos=st.integers(1, 60),
)
@settings(max_examples=80, deadline=None)
def test_codec_sums_within_the_stated_bound_in_either_word_size(rows, silos):
    silos = max(silos, len(rows))
    codec = FixedPointCodec(MIXED, max_silos=silos)
    assert codec.ring.nbytes == 8 * codec.ring.wide + 4 * codec.ring.narrow
    total = codec.ring.zeros()
    vectors = [torch.tensor(r, dtype=torch.float64) for r in rows]
    for v in vectors:
        codec.ring.add(total, codec.encode(v))  # each part wraps around, as masked sums do
    bounds = torch.cat([torch.full((f.size,), f.bound, dtype=torch.float64) for f in MIXED.fields])
    truth = MIXED.unflatten(torch.stack([torch.clamp(v, -bounds, bounds) for v in vectors]).sum(0))
    decoded = MIXED.unflatten(codec.decode(total))
    for f in MIXED.fields:
        error = (decoded[f.name] - truth[f.name]).abs().max().item()
        assert error <= codec.error_bound(f.name) * (1 + 1e-9), f.name  # the float sum itself rounds too
    assert codec.error_bound("delta") <= silos * 2.0**-16


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_is_not():
    """At 40 silos the delta field drops to 22 fractional bits; a value of 0.3 units of 2^-22 rounds to 0
    every time to nearest, but to 1 three times in ten stochastically, so the mean decodes to the value. Each
    vector differs in its count, so each draws its own rounding (from a key its own bytes give)."""
    codec = FixedPointCodec(MIXED, max_silos=40)
    assert (codec.encodings[0].frac_bits, codec.encodings[0].stochastic) == (22, True)
    value = 0.3 * 2.0**-22
    vectors = [torch.tensor([value] * 5 + [0.0] * 3 + [float(k)], dtype=torch.float64) for k in range(2_000)]
    decoded = torch.stack([codec.decode(codec.encode(v))[:5] for v in vectors])
    mean, spread = decoded.mean().item(), decoded.std().item() / (decoded.numel() ** 0.5)
    assert abs(mean - value) < 4 * spread  # ~0.3 · 2^-22, not 0
    assert set(decoded.flatten().tolist()) == {0.0, 2.0**-22}  # off by less than one unit each time


def test_stochastic_rounding_is_the_same_wherever_the_same_vector_is_encoded():
    """A simulation and a consortium encode a silo's vector alike (bit-identical runs); another vector, or a
    stream the caller passes, rounds differently."""
    schema = Schema((Field("delta", (1000,), 10.0, frac_bits=24), Field("n", (), 1e5, frac_bits=0)))
    codec = FixedPointCodec(schema, max_silos=40)  # the delta in 32-bit words at 22 bits, stochastic
    vector = torch.full((1001,), 0.3 * 2.0**-22, dtype=torch.float64)
    first = codec.encode(vector)
    assert np.array_equal(first, FixedPointCodec(schema, max_silos=40).encode(vector.clone()))
    other = vector.clone()
    other[-1] = 1.0  # another count: another key, so other roundings of the same deltas
    assert not np.array_equal(first[:4000], codec.encode(other)[:4000])
    assert not np.array_equal(first, codec.encode(vector, SecureRandom.seeded("caller")))


@given(
    values=st.lists(
        st.one_of(
            st.floats(-20.0, 20.0), st.floats(-1e-300, 1e-300), st.sampled_from([0.0, -10.0, 10.0, 5e-324])
        ),
        min_size=9,
        max_size=9,
    ),
    key=st.binary(min_size=32, max_size=32),
)
@settings(max_examples=60, deadline=None)
def test_stochastic_rounding_is_floor_of_the_value_plus_a_16_bit_uniform(values, key):
    """Known answer of the rounding, which the codec computes in place in blocks: each coordinate is
    ⌊clip(v)·2^f + w·2^-16⌋ for the stream's next 16-bit word w, with float64's one rounding of
    clip(v)·2^(f+16) + w (Python's floats as the oracle), subnormal and clipped values included; and against
    exact rationals it is the floor of the exact sum, or one more where that sum lies within 2^-22 below an
    integer, as the module docstring says."""
    schema = Schema((Field("delta", (8,), 10.0, frac_bits=24), Field("n", (), 1e5, frac_bits=0)))
    codec = FixedPointCodec(schema, max_silos=40)  # the delta at 22 fractional bits, stochastic
    assert (codec.encodings[0].frac_bits, codec.encodings[0].stochastic) == (22, True)
    words = SecureRandom(key).words(2).view("<u2")  # 8 values: two 64-bit words, four 16-bit words each
    encoded = codec.ring.parts(codec.encode(torch.tensor(values, dtype=torch.float64), SecureRandom(key)))[1]
    clipped = [min(max(x, -10.0), 10.0) for x in values[:8]]
    for x, w, got in zip(clipped, words.tolist(), encoded.view(np.int32)[:8].tolist(), strict=True):
        assert got == math.floor((x * 2.0**38 + w) * 2.0**-16)
        exact = Fraction(x) * 2**22 + Fraction(w, 2**16)
        assert got == math.floor(exact) or (
            got == math.floor(exact) + 1 and got - exact <= Fraction(1, 2**22)
        )


def _key_by_definition(values: list[float]) -> bytes:
    """The module docstring's rounding key, computed with Python integers."""
    words = [int.from_bytes(struct.pack("<d", x), "little") for x in values]
    rows = [words[i : i + KEY_ROW] for i in range(0, len(words) // KEY_ROW * KEY_ROW + 1, KEY_ROW)]
    columns = [sum(row[c] for row in rows if c < len(row)) % 2**64 for c in range(KEY_ROW)]
    summary = columns + [sum(row) % 2**64 for row in rows]
    data = (
        ROUNDING_KEY + len(words).to_bytes(8, "little") + b"".join(x.to_bytes(8, "little") for x in summary)
    )
    return hashlib.sha256(data).digest()


@pytest.mark.parametrize("size", [9, 2 * KEY_ROW, 2 * KEY_ROW + 5])
def test_rounding_key_is_sha256_of_the_label_length_and_column_and_row_sums(size):
    """Known answer of the key from its definition, recomputed with Python integers (a float64 word is
    about 2^62, so the sums wrap), for a vector shorter than a row, a whole number of rows and a short last
    row; the codec rounds with the stream this key gives."""
    values = np.append(np.random.default_rng(size).standard_normal(size - 1) * 1e-3, 3.0)
    key = _key_by_definition(values.tolist())
    assert rounding_key(values) == key
    schema = Schema((Field("delta", (size - 1,), 10.0, frac_bits=24), Field("n", (), 1e5, frac_bits=0)))
    codec = FixedPointCodec(schema, max_silos=40)  # the delta in 32-bit words at 22 bits: stochastic
    vector = torch.from_numpy(values)
    assert np.array_equal(codec.encode(vector), codec.encode(vector, SecureRandom(key)))


NEARBY = [0, 1, 2, KEY_ROW, KEY_ROW + 1, 2 * KEY_ROW, 2 * KEY_ROW + 2]  # same row, same column, diagonal


@given(
    base=st.integers(0, 3 * KEY_ROW + 6),
    changes=st.lists(st.tuples(st.sampled_from(NEARBY), st.floats()), min_size=1, max_size=3),
)
@settings(max_examples=150, deadline=None)
def test_rounding_key_changes_when_one_two_or_three_entries_change(base, changes):
    """Changing up to three entries, bunched in one row, one column or across both (the vector's short last
    row included), always changes the key; so does swapping two entries of one row or of one column."""
    values = np.random.default_rng(0).standard_normal(3 * KEY_ROW + 7)
    changed = values.copy()
    for offset, value in changes:
        changed[(base + offset) % len(values)] = value
    if changed.tobytes() != values.tobytes():
        assert rounding_key(changed) != rounding_key(values)
    for other in ((base + 1) % len(values), (base + KEY_ROW) % len(values)):
        swapped = values.copy()
        swapped[[base, other]] = swapped[[other, base]]
        assert rounding_key(swapped) != rounding_key(values)


def test_rounding_key_can_repeat_only_for_four_changes_cancelling_in_rows_and_columns():
    """The limit the module docstring states, and that it is the limit: four changed entries at the corners
    of a rectangle, +d and −d on each row and each column, keep every sum; moving one corner does not."""
    values = np.random.default_rng(1).standard_normal(3 * KEY_ROW)
    words = values.view(np.uint64).copy()
    words[[7, 900 + 2 * KEY_ROW]] += np.uint64(12345)  # wrapping mod 2^64, as the sums do
    words[[900, 7 + 2 * KEY_ROW]] -= np.uint64(12345)
    assert rounding_key(words.view(np.float64)) == rounding_key(values)
    words[[900, 901]] = words[[901, 900]]  # now one of the corners sits in another column
    assert rounding_key(words.view(np.float64)) != rounding_key(values)


class _EveryWord:
    """A stand-in stream (a deterministic fake) whose 16-bit words run through 0 … 2^16 − 1 in order, so a
    field of 2^16 equal values is rounded with every uniform exactly once."""

    def __init__(self) -> None:
        self._next = 0

    def words(self, count: int) -> np.ndarray:
        uniforms = (np.arange(4 * count) + self._next) % 2**16
        self._next += 4 * count
        return uniforms.astype("<u2").view("<u8")


EXACT_BIAS_SCHEMA = Schema((Field("delta", (2**16,), 10.0, frac_bits=24), Field("n", (), 1e5, frac_bits=0)))


@given(units=st.one_of(st.floats(-4e7, 4e7), st.integers(-(2**25), 2**25).map(lambda k: k - 2**-23)))
@settings(max_examples=60, deadline=None)
def test_stochastic_rounding_bias_over_every_uniform_is_within_the_stated_bound(units):
    """The exact expectation: with each 16-bit uniform once, the mean encoding of a value s (in units of
    2^-22) lies in (s − 2^-16, s + 2^-22], and a value on the grid of units is encoded exactly every time.
    Fewer random bits (or rounding to nearest) would miss this bound; values just below an integer
    (k − 2^-23) sit near its lower end."""
    codec = FixedPointCodec(EXACT_BIAS_SCHEMA, max_silos=40)
    assert (codec.encodings[0].frac_bits, codec.encodings[0].stochastic) == (22, True)
    assert ENCODE_BLOCK % 4 == 0  # so blocks read the fake stream's words in order too
    value = units * 2.0**-22
    vector = torch.cat(
        [torch.full((2**16,), value, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    )
    encoded = codec.ring.parts(codec.encode(vector, _EveryWord()))[1].view(np.int32)[: 2**16].astype(np.int64)
    s = Fraction(value) * 2**22
    mean = Fraction(int(encoded.sum()), 2**16)
    assert -Fraction(1, 2**16) < mean - s <= Fraction(1, 2**22)
    assert set(encoded.tolist()) <= {math.floor(s), math.floor(s) + 1}
    if s.denominator == 1:
        assert set(encoded.tolist()) == {s}


def test_stochastic_rounding_rounds_up_as_often_as_the_fraction_in_keyed_vectors():
    """Statistics of the real keyed streams: 200,000 values of each fraction φ of a unit in each of 10
    vectors (each its own key), at integer parts spread over ±1000 units. The share rounded up is φ within
    four standard errors (plus the 2^-16 the docstring allows), and the mean rounding error is 0 within four
    standard errors: a bias of 2^-8, rounding to nearest or one uniform for many values would fail."""
    fractions = np.array([2.0**-10, 0.125, 0.3, 0.5, 0.7, 1 - 2.0**-12])
    per = 20_000  # of each fraction in each vector
    schema = Schema(
        (Field("delta", (len(fractions) * per,), 10.0, frac_bits=24), Field("n", (), 1e5, frac_bits=0))
    )
    codec = FixedPointCodec(schema, max_silos=40)
    assert (codec.encodings[0].frac_bits, codec.encodings[0].stochastic) == (22, True)
    rng = np.random.default_rng(37)
    ups, errors = [], []
    for vector_index in range(10):
        whole = rng.integers(-1000, 1000, size=(len(fractions), per)).astype(np.float64)
        units = whole + fractions[:, None]
        vector = torch.from_numpy(np.append(units.ravel() * 2.0**-22, float(vector_index)))
        encoded = codec.ring.parts(codec.encode(vector))[1].view(np.int32)[: units.size].reshape(units.shape)
        ups.append(encoded - whole)
        errors.append(encoded - units)
    up = np.concatenate(ups, axis=1)
    assert set(np.unique(up).tolist()) <= {0, 1}
    samples = up.shape[1]
    for phi, share in zip(fractions, up.mean(axis=1), strict=True):
        assert abs(share - phi) < 4 * math.sqrt(phi * (1 - phi) / samples) + 2.0**-16, phi
    error = np.concatenate(errors, axis=1)
    assert abs(error.mean()) < 4 * error.std() / math.sqrt(error.size) + 2.0**-16


def test_codec_refuses_a_round_that_could_overflow():
    wide = Schema((Field("stat", (6,), 1000.0, frac_bits=52, sensitivity=1.0),))
    with pytest.raises(OverflowRisk, match="could overflow 64 bits in stat"):
        FixedPointCodec(wide, max_silos=100)
    FixedPointCodec(Schema((Field("stat", (6,), 1000.0, frac_bits=40, sensitivity=1.0),)), max_silos=100)


def test_codec_refuses_wrong_shapes_and_non_finite_values():
    codec = FixedPointCodec(MIXED, max_silos=2)
    with pytest.raises(ValueError, match="schema needs"):
        codec.encode(torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(torch.tensor([float("nan")] * 9))


def test_shamir_catches_a_corrupted_share_beyond_the_threshold():
    secret = secrets.token_bytes(32)
    parts = shamir.split(secret, shares=5, threshold=3)
    parts[5] = (parts[5] + 1) % shamir.PRIME  # the first three alone would still rebuild the secret
    with pytest.raises(shamir.ShamirError, match="inconsistent or tampered"):
        shamir.combine(parts, threshold=3)
    del parts[5]
    assert shamir.combine(parts, threshold=3) == secret
