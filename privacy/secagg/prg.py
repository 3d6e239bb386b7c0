"""The mask generator: ChaCha20 keyed with the whole 256-bit seed, read as little-endian uint64 words.

A peer's mask must be unpredictable without its seed, so it comes from a cipher keystream, never from a
statistical generator seeded with a folded-down seed (the weakness of Flower's SecAgg+, flwrlabs/flower
#7522). ChaCha20 is RFC 8439's (key, 32-bit block counter starting at 0, 96-bit nonce of zeros): each seed is
used for exactly one stream, so a fixed nonce is safe.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
_NONCE = bytes(16)  # cryptography's 16-byte ChaCha20 nonce: 4-byte little-endian counter, then 12-byte nonce


def mask(seed: bytes, words: int) -> np.ndarray:
    """`words` pseudo-random uint64 values determined by `seed` alone."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    if words < 0:
        raise ValueError(f"words must be >= 0, got {words}")
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor().update(bytes(8 * words))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64, copy=False)
