"""The DP noise source (`privacy.dp.noise.SecureRandom`): its keystream, uniforms and Gaussians."""

import math

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from privacy.dp.noise import SecureRandom

KEY = bytes(range(32))


def test_keystream_is_aes256_ctr_from_block_zero():
    """Known answer by another route: the words are AES-256 (ECB, one block at a time) of the counter blocks
    0, 1, 2, ... (big-endian), read as little-endian 64-bit words."""
    ecb = Cipher(algorithms.AES(KEY), modes.ECB()).encryptor()
    blocks = b"".join(ecb.update(i.to_bytes(16, "big")) for i in range(3))
    expected = np.frombuffer(blocks, dtype="<u8")
    np.testing.assert_array_equal(SecureRandom(KEY).words(6), expected)
    # the known answer of FIPS-197 C.3 (AES-256), so the ECB route is itself AES-256
    fips = (
        Cipher(algorithms.AES(KEY), modes.ECB())
        .encryptor()
        .update(bytes.fromhex("00112233445566778899aabbccddeeff"))
    )
    assert fips.hex() == "8ea2b7ca516745bfeafc49904b496089"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gaussian_has_the_asked_std_and_shape(dtype):
    """Guards the noise level DP-SGD's guarantee rests on: 400,000 draws have std within 1%, mean within
    4 standard errors, and pass a Kolmogorov–Smirnov test against N(0, std²)."""
    std = 2.5
    draws = SecureRandom.seeded(f"gauss-{dtype}").gaussian((400, 1000), std, dtype)
    assert draws.shape == (400, 1000)
    assert draws.dtype == dtype
    flat = draws.double().flatten().numpy()
    assert flat.std() == pytest.approx(std, rel=0.01)
    assert abs(flat.mean()) < 4 * std / math.sqrt(flat.size)
    assert stats.kstest(flat / std, "norm").pvalue > 1e-3


def test_float32_uniforms_are_words_over_two_to_the_32():
    """Guards the tails: a float32 uniform is (w + ½)·2⁻³² of a 32-bit word w, to float32's precision, so it
    reaches down to 2⁻³³ (float32 bits taken as a mantissa would stop at 2⁻²³) and is never 0, whose logarithm
    would be an infinite draw."""
    count = 1 << 20
    values = SecureRandom.seeded("uniform")._uniforms(count, torch.float32).double().numpy()
    words = SecureRandom.seeded("uniform").words(count // 2).view("<u4").astype(np.float64)
    np.testing.assert_allclose(values, (words + 0.5) / 2.0**32, rtol=2.0**-23, atol=0)
    assert values.min() > 0
    assert values.max() <= 1.0


def test_each_draw_is_fresh_and_not_overwritten_by_the_next():
    """Guards the reused scratch buffers: the result of one call survives the next call unchanged (DP-SGD
    adds a step's noise while the next step's is drawn), and two calls differ."""
    rng = SecureRandom.seeded("fresh")
    first = rng.gaussian((50_000,), 1.0)
    kept = first.clone()
    second = rng.gaussian((50_000,), 1.0)
    assert torch.equal(first, kept)
    assert not torch.equal(first, second)
    assert not torch.equal(SecureRandom().gaussian((8,), 1.0), SecureRandom().gaussian((8,), 1.0))


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="float32 or float64"):
        SecureRandom.seeded(0).gaussian((4,), 1.0, torch.float16)


@pytest.mark.parametrize("drawn", [0, 1, 5, 130])
def test_a_pickled_stream_goes_on_where_it_was(drawn):
    """The simulator's Ray backend moves a silo's stream to another process: a copy must draw exactly what the
    original would have drawn next, from any position (5 words end mid-block)."""
    import pickle

    original = SecureRandom(KEY)
    original.words(drawn)
    copy = pickle.loads(pickle.dumps(original))
    np.testing.assert_array_equal(copy.words(7), SecureRandom(KEY).words(drawn + 7)[drawn:])
    np.testing.assert_array_equal(original.words(7), SecureRandom(KEY).words(drawn + 7)[drawn:])
