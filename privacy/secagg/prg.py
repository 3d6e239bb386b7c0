"""The mask generator: ChaCha20 keyed with the whole 256-bit seed, read as little-endian uint64 words.

A peer's mask must be unpredictable without its seed, so it comes from a cipher keystream, never from a
statistical generator seeded with a folded-down seed (the weakness of Flower's SecAgg+, flwrlabs/flower
#7522). ChaCha20 is RFC 8439's (key, 32-bit block counter starting at 0, 96-bit nonce of zeros): each seed is
used for exactly one stream, so a fixed nonce is safe.

`apply_masks` adds or subtracts masks in place, a cache-sized block at a time, so masking a large vector
costs little more than generating its keystream (benchmarks/secagg.py measures the ratio).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    apply_masks(out, [(seed, False)])
    return out


def apply_masks(target: np.ndarray, masks: Sequence[tuple[bytes, bool]]) -> None:
    """target ← target ± every (seed, subtract) mask, block-major: each block of `target` is read and written
    once for all the masks while it sits in cache, instead of once per mask."""
    if target.dtype != np.uint64 or target.ndim != 1 or not target.flags.c_contiguous:
        raise ValueError("apply_masks needs a contiguous 1-D uint64 array")
    if any(len(seed) != SEED_BYTES for seed, _ in masks):
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes")
    streams = [
        (
            Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor(),
            np.subtract if subtract else np.add,
        )
        for seed, subtract in masks
    ]
    buffer = bytearray(8 * BLOCK_WORDS + 64)
    block = np.frombuffer(buffer, dtype="<u8", count=BLOCK_WORDS)
    for start in range(0, len(target), BLOCK_WORDS):
        part = target[start : start + BLOCK_WORDS]
        for encryptor, combine in streams:
            encryptor.update_into(_ZEROS[: 8 * len(part)], buffer)
            combine(part, block[: len(part)], out=part)
