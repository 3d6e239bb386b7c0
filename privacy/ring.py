"""The ring a secure sum lives in: some 64-bit words, then some 32-bit words, as one little-endian buffer.

Secagg's codec (`privacy.secagg.codec.FixedPointCodec`) puts each field in the narrowest words whose range
holds the sum of every silo's value, so a model delta costs 4 bytes a number instead of 8. Masks and sums wrap
within each part: mod 2^64 in the wide part, mod 2^32 in the narrow one. The wide part comes first so that
both parts sit at offsets aligned for their word size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
