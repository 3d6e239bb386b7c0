"""Randomness for differential privacy from a cipher keystream, never from a statistical generator.

Opacus' `secure_mode` draws its noise from torchcsprng, which has no wheel for this Python; torch's and
numpy's own generators are statistical ones whose state can be recovered from their outputs. Here every
uniform comes from ChaCha20 (the `cryptography` package) keyed with 256 bits from `os.urandom`; only tests
pass a seed, through `SecureRandom.seeded`. Gaussians follow Opacus' secure mode (Holohan & Braghin 2021,
§5.1): each is the sum of four Box–Muller draws divided by two, so the low bits of one floating-point draw
do not give the draw away. Poisson draws (for Skellam noise) use Hörmann's PTRS, the transformed rejection
numpy itself uses for large means, fed from the same keystream.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy.special import gammaln

_NONCE = bytes(16)
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)
_SLACK = 64  # update_into wants room for a cipher block beyond the input
_ONE = np.uint64(0x3FF0000000000000)  # the bits of 1.0
_SMALL_MEAN = 10.0  # below it a Poisson draw counts uniforms (Knuth); above it PTRS


class SecureRandom:
    """One ChaCha20 keystream read as 64-bit words; not thread-safe (one per silo and purpose)."""

    def __init__(self, key: bytes | None = None) -> None:
        key = os.urandom(32) if key is None else key
        if len(key) != 32:
            raise ValueError("a SecureRandom key has 32 bytes")
        self._stream = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()

    @classmethod
    def seeded(cls, seed: int | str) -> SecureRandom:
        """Reproducible noise, for tests and benchmarks only: a seeded stream is as good as its seed."""
        return cls(hashlib.sha256(f"fedlt-dp-test-seed\x1f{seed}".encode()).digest())

    def spawn(self) -> SecureRandom:
        """An independent stream keyed from this one's next 32 bytes (seeded streams spawn seeded ones), for
        a consumer on another thread, so that the order of draws on each stays fixed."""
        return SecureRandom(self.words(4).tobytes())

    def words(self, count: int) -> np.ndarray:
        """The next `count` keystream words, written in place a chunk at a time (no zero-filled copy)."""
        out = np.empty(count + _SLACK // 8, dtype="<u8")
        view = memoryview(out).cast("B")
        for start in range(0, 8 * count, _CHUNK):
            size = min(_CHUNK, 8 * count - start)
            self._stream.update_into(_ZEROS[:size], view[start : start + size + _SLACK])
        return out[:count]

    def uniform(self, count: int) -> np.ndarray:
        """Doubles in (0, 1] with 52 random bits each (never 0, so logarithms are safe): the top 52 bits
        of a word as the mantissa of a double in [1, 2), taken from 2, in place."""
        bits = self.words(count)
        np.right_shift(bits, np.uint64(12), out=bits)
        np.bitwise_or(bits, _ONE, out=bits)
        values = bits.view(np.float64)
        np.subtract(2.0, values, out=values)
        return values

    def _normals(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """Box–Muller on pairs of 52-bit uniforms, computed in `dtype` (float32 for gradients, as Opacus'
        secure mode draws them; the uniforms keep their range, so the tails reach 8.5 standard deviations)."""
        half = (count + 1) // 2
        u = torch.from_numpy(self.uniform(2 * half)).to(dtype)
        radius = torch.sqrt(-2.0 * torch.log(u[:half]))
        angle = (2.0 * math.pi) * u[half:]
        return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]

    def gaussian(self, shape: tuple[int, ...] | torch.Size, std: float, dtype=torch.float32) -> torch.Tensor:
        """N(0, std²) of `shape`, each the sum of four draws divided by two (Opacus' secure mode)."""
        count = math.prod(shape)
        draws = self._normals(4 * count, dtype).view(4, count).sum(dim=0)
        return draws.mul_(std / 2.0).reshape(shape)

    def bernoulli(self, count: int, p: float) -> np.ndarray:
        """`count` independent booleans, each True with probability p (Poisson sampling of a batch)."""
        return self.uniform(count) <= p

    def poisson(self, mean: float, count: int) -> np.ndarray:
        """`count` independent Poisson(mean) integers."""
        if mean < 0 or not math.isfinite(mean):
            raise ValueError(f"a Poisson mean is finite and >= 0, got {mean}")
        if mean == 0:
            return np.zeros(count, dtype=np.int64)
        return self._poisson_small(mean, count) if mean < _SMALL_MEAN else self._ptrs(mean, count)

    def skellam(self, mean: float, count: int) -> np.ndarray:
        """`count` Skellam draws: Poisson(mean) − Poisson(mean), variance 2·mean, symmetric, integer."""
        return self.poisson(mean, count) - self.poisson(mean, count)

    def _poisson_small(self, mean: float, count: int) -> np.ndarray:
        """Knuth's product of uniforms, vectorised: count how many uniforms keep the product above e^−mean."""
        limit = math.exp(-mean)
        out = np.zeros(count, dtype=np.int64)
        product = np.ones(count)
        alive = np.arange(count)
        while alive.size:
            product[alive] *= self.uniform(alive.size)
            still = product[alive] > limit
            out[alive[still]] += 1
            alive = alive[still]
        return out

    def _ptrs(self, mean: float, count: int) -> np.ndarray:
        """Hörmann (1993), 'The transformed rejection method for generating Poisson random variables'."""
        slam = math.sqrt(mean)
        loglam = math.log(mean)
        b = 0.931 + 2.53 * slam
        a = -0.059 + 0.02483 * b
        invalpha = 1.1239 + 1.1328 / (b - 3.4)
        vr = 0.9277 - 3.6224 / (b - 2)
        out = np.empty(count, dtype=np.int64)
        todo = np.arange(count)
        while todo.size:
            u = self.uniform(todo.size) - 0.5
            v = self.uniform(todo.size)
            us = 0.5 - np.abs(u)
            k = np.floor((2 * a / us + b) * u + mean + 0.43)
            quick = (us >= 0.07) & (v <= vr)
            accept = quick.copy()
            slow = ~quick & (k >= 0) & ~((us < 0.013) & (v > us))
            ks, uss = k[slow], us[slow]
            log_v = np.log(v[slow] * invalpha / (a / (uss * uss) + b))
            accept[slow] = log_v <= -mean + ks * loglam - gammaln(ks + 1)
            out[todo[accept]] = k[accept].astype(np.int64)
            todo = todo[~accept]
        return out
