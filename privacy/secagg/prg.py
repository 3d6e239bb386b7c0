"""The mask generator: ChaCha20 keyed with the whole 256-bit seed, read as little-endian uint64 words.

A peer's mask must be unpredictable without its seed, so it comes from a cipher keystream, never from a
statistical generator seeded with a folded-down seed (the weakness of Flower's SecAgg+, flwrlabs/flower
#7522). ChaCha20 is RFC 8439's (key, 32-bit block counter starting at 0, 96-bit nonce of zeros): each seed is
used for exactly one stream, so a fixed nonce is safe.

`apply_mask` adds or subtracts a mask in place, a cache-sized block at a time, so masking a large vector
costs little more than generating its keystream (benchmarks/secagg.py measures the ratio).
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
BLOCK_WORDS = 1 << 15  # 256 KiB of keystream per step: stays in cache between generation and addition
_NONCE = bytes(16)  # cryptography's 16-byte ChaCha20 nonce: 4-byte little-endian counter, then 12-byte nonce
_ZEROS = bytes(8 * BLOCK_WORDS)


def mask(seed: bytes, words: int) -> np.ndarray:
    """`words` pseudo-random uint64 values determined by `seed` alone."""
    if words < 0:
        raise ValueError(f"words must be >= 0, got {words}")
    out = np.zeros(words, dtype=np.uint64)
    apply_mask(out, seed)
    return out


def apply_mask(target: np.ndarray, seed: bytes, *, subtract: bool = False) -> None:
    """target ← target ± mask(seed, len(target)) in Z_2^64, without materialising the whole mask."""
    if target.dtype != np.uint64 or target.ndim != 1 or not target.flags.c_contiguous:
        raise ValueError("apply_mask needs a contiguous 1-D uint64 array")
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    buffer = bytearray(8 * BLOCK_WORDS + 64)
    block = np.frombuffer(buffer, dtype="<u8", count=BLOCK_WORDS)
    combine = np.subtract if subtract else np.add
    for start in range(0, len(target), BLOCK_WORDS):
        part = target[start : start + BLOCK_WORDS]
        encryptor.update_into(_ZEROS[: 8 * len(part)], buffer)
        combine(part, block[: len(part)], out=part)
