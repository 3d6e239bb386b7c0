"""Randomness for differential privacy from a cipher keystream, never from a statistical generator.

Opacus' `secure_mode` draws its noise from torchcsprng, which has no wheel for this Python; torch's and
numpy's own generators are statistical ones whose state can be recovered from their outputs. Here every
uniform comes from AES-256 in counter mode (the `cryptography` package, AES-NI: twice ChaCha20's speed on
this machine, 5 against 11 ms for DP-SGD's 26 MB a step) keyed with 256 bits from `os.urandom`; only tests
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
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy.special import gammaln

_COUNTER = bytes(16)  # each key draws one stream, from block 0
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)
_SLACK = 64  # update_into wants room for a cipher block beyond the input
_ONE = np.uint64(0x3FF0000000000000)  # the bits of 1.0
_SMALL_MEAN = 10.0  # below it a Poisson draw counts uniforms (Knuth); above it PTRS


class SecureRandom:
    """One AES-256-CTR keystream read as 64-bit words; not thread-safe (one per silo and purpose).

    It pickles as its key and position, so that a simulated silo's stream can move with its work to another
    process and on from where it was (the simulator's Ray backend); the key travels with it."""

    def __init__(self, key: bytes | None = None, *, position: int = 0) -> None:
        key = os.urandom(32) if key is None else key
        if len(key) != 32:
            raise ValueError("a SecureRandom key has 32 bytes")
        block, skip = divmod(position, 16)
        counter = ((int.from_bytes(_COUNTER, "big") + block) % 2**128).to_bytes(16, "big")
        self._key, self._position = key, position
        self._stream = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
        self._stream.update(bytes(skip))
        self._buffers: dict[str, np.ndarray] = {}

    def __reduce__(self) -> tuple:
        return SecureRandom._at, (self._key, self._position)

    @classmethod
    def _at(cls, key: bytes, position: int) -> SecureRandom:
        return cls(key, position=position)

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
        return self._fill(out, count)

    def _fill(self, out: np.ndarray, count: int) -> np.ndarray:
        view = memoryview(out).cast("B")
        for start in range(0, 8 * count, _CHUNK):
            size = min(_CHUNK, 8 * count - start)
            self._stream.update_into(_ZEROS[:size], view[start : start + size + _SLACK])
            self._position += size
        return out[:count]

    def _scratch(self, name: str, count: int, dtype: np.dtype | str) -> np.ndarray:
        """A buffer kept between calls: fresh multi-megabyte arrays each step cost more in page faults than
        the arithmetic on them."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < count or buffer.dtype != np.dtype(dtype):
            buffer = self._buffers[name] = np.empty(count, dtype)
        return buffer[:count]

    def uniform(self, count: int) -> np.ndarray:
        """Doubles in (0, 1] with 52 random bits each (never 0, so logarithms are safe): the top 52 bits
        of a word as the mantissa of a double in [1, 2), taken from 2, in place."""
        bits = self.words(count)
        np.right_shift(bits, np.uint64(12), out=bits)
        np.bitwise_or(bits, _ONE, out=bits)
        values = bits.view(np.float64)
        np.subtract(2.0, values, out=values)
        return values

    def _uniforms(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """Uniforms in (0, 1] as `dtype`: float64 from 52-bit words (`uniform`); float32 from 32-bit words,
        (w + ½)·2⁻³², which rounds to float32's 24-bit mantissa but keeps the range down to 2⁻³³, for half the
        keystream of 64-bit words (DP-SGD draws millions a step). The float32 ones live in a scratch buffer,
        overwritten by the next call."""
        if dtype == torch.float64:
            return torch.from_numpy(self.uniform(count))
        if dtype != torch.float32:
            raise ValueError(f"noise is drawn in float32 or float64, not {dtype}")
        halves = (count + 1) // 2
        words = self._fill(self._scratch("words", halves + _SLACK // 8, "<u8"), halves)
        u = self._scratch("uniforms", count, np.float32)
        u[:] = words.view("<u4")[:count]
        u += np.float32(0.5)
        u *= np.float32(2.0**-32)
        return torch.from_numpy(u)

    def gaussian(self, shape: tuple[int, ...] | torch.Size, std: float, dtype=torch.float32) -> torch.Tensor:
        """N(0, std²) of `shape`, each the sum of four Box–Muller draws divided by two (Opacus' secure mode),
        computed in `dtype` (float32 for gradients, as Opacus draws them; the tails of one draw reach 6.8
        standard deviations in float32 and 8.5 in float64). Both outputs of each Box–Muller pair are used,
        in place in scratch buffers; only the result is a fresh tensor."""
        count = math.prod(shape)
        u = self._uniforms(4 * count, dtype)
        radius = u[: 2 * count].log_().mul_(-2.0).sqrt_()
        angle = u[2 * count :].mul_(2.0 * math.pi)
        cos = torch.from_numpy(self._scratch("cos", 2 * count, u.numpy().dtype))
        torch.cos(angle, out=cos).mul_(radius)
        sin = angle.sin_().mul_(radius)
        draws = torch.add(cos[:count], cos[count:]).add_(sin[:count]).add_(sin[count:])
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
