"""The ring a secure sum lives in, and the keystream its masks come from.

The ring: some 64-bit words, then some 32-bit words, as one little-endian buffer.

Secagg's codec (`privacy.secagg.codec.FixedPointCodec`) puts each field in the narrowest words whose range
holds the sum of every silo's value, so a model delta costs 4 bytes a number instead of 8. Masks and sums wrap
within each part: mod 2^64 in the wide part, mod 2^32 in the narrow one. The wide part comes first so that
both parts sit at offsets aligned for their word size.

The masks come from a block cipher's keystream keyed with the whole 256-bit seed: secagg's masks and the
release masks of `privacy.stepping.masks` are drawn from it. A peer's mask must be unpredictable without its
seed, so it comes from a cipher keystream, never from a statistical generator seeded with a folded-down seed
(the weakness of Flower's SecAgg+, flwrlabs/flower #7522). Two keystreams are known here, both from
`cryptography` (OpenSSL):
- `aes-128-ctr`: the seed's first 16 bytes are the AES key, its last 16 the initial counter block (NIST SP
  800-38A's CTR, the counter block incremented as one 128-bit big-endian number). With AES-NI it is the
  faster of the two on this machine's kind, 2.1–2.5× (`benchmarks/secagg.py session`); masks use it.
- `chacha20`: RFC 8439's (the seed is the key, a 32-bit block counter from 0, a 96-bit nonce of zeros), the
  generator of earlier versions; kept so the benchmark measures the choice in every run.
Each seed is used for exactly one stream, so a fixed nonce (or a counter block taken from the seed) is safe.

`apply_masks` adds or subtracts masks in place over a ring (`Ring`), a cache-sized block at a time, so
masking a large vector costs little more than generating its keystream (benchmarks/secagg.py measures the
ratio). The keystream covers the ring's bytes in order: its wide words, then its narrow ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

WIDE, NARROW = np.dtype("<u8"), np.dtype("<u4")


@dataclass(frozen=True)
class Ring:
    wide: int  # 64-bit words
    narrow: int = 0  # 32-bit words

    def __post_init__(self) -> None:
        if self.wide < 0 or self.narrow < 0 or self.wide + self.narrow < 1:
            raise ValueError(f"a ring needs at least one word, got {self.wide} wide and {self.narrow} narrow")

    @property
    def nbytes(self) -> int:
        return WIDE.itemsize * self.wide + NARROW.itemsize * self.narrow

    def zeros(self) -> np.ndarray:
        return np.zeros(self.nbytes, dtype=np.uint8)

    def parts(self, vector: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views of `vector`'s wide and narrow words: writing to them writes to `vector`."""
        self.check(vector)
        split = WIDE.itemsize * self.wide
        return vector[:split].view(WIDE), vector[split:].view(NARROW)

    def check(self, vector: np.ndarray) -> None:
        if vector.dtype != np.uint8 or vector.shape != (self.nbytes,) or not vector.flags.c_contiguous:
            raise ValueError(
                f"a vector of this ring is {self.nbytes} contiguous bytes "
                f"({self.wide} 64-bit and {self.narrow} 32-bit words), got {vector.dtype} {vector.shape}"
            )

    def add(self, total: np.ndarray, vector: np.ndarray) -> None:
        """total ← total + vector, word by word, each part wrapping at its own width."""
        for into, part in zip(self.parts(total), self.parts(vector), strict=True):
            np.add(into, part, out=into)

    def random(self, rng: np.random.Generator) -> np.ndarray:
        """A uniform element of the ring (for tests and benchmarks)."""
        return rng.integers(0, 256, self.nbytes, dtype=np.uint8)


SEED_BYTES = 32
BLOCK_BYTES = 1 << 18  # 256 KiB of keystream per step: stays in cache between generation and addition
_SLACK = 64  # update_into wants room for a cipher block beyond its input
_ZEROS = bytes(BLOCK_BYTES)


def _aes_128_ctr(seed: bytes) -> CipherContext:
    return Cipher(algorithms.AES(seed[:16]), modes.CTR(seed[16:])).encryptor()


def _chacha20(seed: bytes) -> CipherContext:
    # cryptography's 16-byte ChaCha20 nonce: the 4-byte little-endian counter, then RFC 8439's 12-byte nonce
    return Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()


KEYSTREAMS: dict[str, Callable[[bytes], CipherContext]] = {"aes-128-ctr": _aes_128_ctr, "chacha20": _chacha20}
MASK_KEYSTREAM = "aes-128-ctr"


def stream(seed: bytes, keystream: str = MASK_KEYSTREAM) -> CipherContext:
    """The keystream of `seed`, read by encrypting zeros."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    return KEYSTREAMS[keystream](seed)


def keystream_bytes(seed: bytes, count: int, keystream: str = MASK_KEYSTREAM) -> bytes:
    """The first `count` bytes of `seed`'s keystream."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return stream(seed, keystream).update(bytes(count))


def mask(seed: bytes, words: int) -> np.ndarray:
    """`words` pseudo-random uint64 values determined by `seed` alone."""
    if words < 0:
        raise ValueError(f"words must be >= 0, got {words}")
    ring = Ring(words) if words else None
    out = np.zeros(8 * words, dtype=np.uint8)
    if ring is not None:
        apply_masks(ring, out, [(seed, False)])
    return out.view("<u8").astype(np.uint64, copy=False)


def apply_masks(ring: Ring, target: np.ndarray, masks: Sequence[tuple[bytes, bool]]) -> None:
    """target ← target ± every (seed, subtract) mask, block-major: each block of `target` is read and written
    once for all the masks while it sits in cache, instead of once per mask."""
    streams = [(stream(seed), np.subtract if subtract else np.add) for seed, subtract in masks]
    buffer = bytearray(BLOCK_BYTES + _SLACK)
    for part in ring.parts(target):
        step = BLOCK_BYTES // part.itemsize
        block = np.frombuffer(buffer, dtype=part.dtype, count=step)
        for start in range(0, len(part), step):
            words = part[start : start + step]
            for encryptor, combine in streams:
                encryptor.update_into(_ZEROS[: words.nbytes], buffer)
                combine(words, block[: len(words)], out=words)
