"""The ring a secure sum lives in, the fixed-point encoding of a schema's fields into it, and the keystream
its masks come from.

The ring: some 64-bit words, then some 32-bit words, as one little-endian buffer. Masks and sums wrap within
each part: mod 2^64 in the wide part, mod 2^32 in the narrow one. The wide part comes first so that both parts
sit at offsets aligned for their word size.

The encoding (`FixedPointCodec`, secagg's codec) puts each field in the narrowest words whose range holds the
sum of every silo's value, so a model delta costs 4 bytes a number instead of 8. A value x of a field with
bound B, encoded with f fractional bits, becomes the integer round(x · 2^f) as a two's-complement word.
Summing n encodings with wrap-around and reading the result as a signed word gives the sum of the rounded
values, exactly, as long as it fits: |sum| ≤ n · ⌈B · 2^f⌉ < 2^(w−1) for w-bit words. The codec picks, per
field, for the round's n silos:
1. 32-bit words at the field's own precision f (its `frac_bits`) if the sum fits them;
2. else 32-bit words at the highest precision f' that fits, if f' ≥ `NARROW_MIN_FRAC_BITS` and the field is
   not a DP statistic (its noise is calibrated in units of the field's own precision, `privacy.dp.release`);
   precision drops here, so values are rounded stochastically (unbiased: E[encoded] = x · 2^f');
3. else 64-bit words at f, if the sum fits them; a round that could overflow even those is refused when the
   codec is made (`OverflowRisk`), before any silo encodes anything.
A model delta of bound 10 at 24 fractional bits fits 32-bit words up to 12 silos, and at 22 up to 51.

Rounding to nearest is off by at most 2^−(f+1) a value, so a decoded sum of n values is within n · 2^−(f+1)
of the sum of the clipped values. Stochastic rounding is off by less than 2^−f' a value (n · 2^−f' for the
sum): a value v, clipped and scaled to s = v · 2^f', becomes ⌊s + w · 2^−16⌋ for a uniform 16-bit word w
(`UNIFORM_BITS`), so it rounds up with probability frac(s) to 2^−16. Exactly: over the 2^16 words the
encodings average ⌊2^16 s⌋ · 2^−16, less than 2^−16 of a unit below s. The codec computes
⌊(2^16 s + w) · 2^−16⌋ in float64; |2^16 s + w| < 2^48 (s fits a 32-bit word), so the sum rounds once, by
at most 2^−22 of a unit, which can only lift an s lying within 2^−22 of a unit below a multiple of 2^−16 onto
that multiple. So E[encoded] − s lies in (−2^−16, 2^−22] units: unbiased to 2^−16 of a unit, 2^−(f'+16) in
value, n · 2^−(f'+16) for a sum; a value on the grid of units is encoded exactly. (Earlier versions drew
32-bit uniforms and promised 2^−32, but their sum, up to 2^63 in magnitude, rounded by up to 2^−23 of a unit.)

The uniforms come from a CSPRNG (AES-256-CTR, `privacy.dp.noise.SecureRandom`; each stochastic field takes
the stream's next ⌈size/4⌉ 64-bit words, each read as four little-endian 16-bit words) keyed with
`rounding_key`: SHA-256 of `ROUNDING_KEY`, the vector's length (8 bytes, little-endian) and a summary of the
vector. The summary reads its float64 values as 64-bit integers, lays them out in rows of `KEY_ROW` (4,096;
the last row short, possibly empty) and takes the sum mod 2^64 of every column, then of every row, each
written as 8 little-endian bytes. Why that key is safe:
- Only the silo can know it: it is computed from the silo's own vector, which the aggregator never sees, and
  nothing the aggregator knows or picks enters it. With all other entries fixed, distinct values of any one
  entry give distinct column sums, so the key is at least as hard to guess as any single entry.
- It is fresh whenever the vector changes: if one, two or three entries change, some row or some column
  holds exactly one changed entry, and its sum changes. Vectors with equal summaries differ in at least four
  entries, with every row and column that holds a changed entry holding at least two whose changes cancel
  mod 2^64 (a swap of two entries always shows). SHA-256 turns distinct summaries into distinct keys.
- It is the same wherever the same vector is encoded (integer sums are exact in any order, and read from
  the values rather than from their bytes in memory), so a simulation and a consortium still give the same
  sums bit for bit (a caller may pass its own stream).
The summary costs two numpy reductions over the vector, 0.35–0.7 ms for 9.8 MB (read from cache or from
memory) where SHA-256 of its bytes took about 5 ms (`benchmarks/codec.py` measures the encode). The rounding
of one vector is thereby fixed; across vectors its errors are independent and unbiased, which is what the
sums need. `error_bound` states the bound per field.

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

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from fedlt.aggregation import Schema
from fedlt.aggregation.halves import SettingsRefused
from fedlt.aggregation.schema import Field
from privacy.dp.noise import SecureRandom

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


NARROW_MIN_FRAC_BITS = 16
# named when the codec lived in secagg; v2: the key from the vector's row and column sums, 16-bit uniforms
ROUNDING_KEY = b"fedlt/secagg/stochastic-rounding/v2\x1f"
KEY_ROW = 4096  # 64-bit words per row of the rounding key's summary
UNIFORM_BITS = 16  # of the uniform that rounds one value stochastically
# values per step of encode: two float64 scratch rows of 512 KiB (the fastest of 2^14 to 2^17 here)
ENCODE_BLOCK = 1 << 16
_LIMITS = {32: 2**31, 64: 2**63}


class OverflowRisk(SettingsRefused):
    """A round whose sums could leave 64-bit words at these bounds, silo count and precision."""


@dataclass(frozen=True)
class FieldEncoding:
    """How one field travels: in `bits`-bit words with `frac_bits` fractional bits, rounded stochastically
    when `stochastic` (its own precision did not fit those words)."""

    field: Field
    bits: int
    frac_bits: int
    stochastic: bool

    def error_bound(self, silos: int) -> float:
        """The most a decoded sum of `silos` encodings is off from the sum of the clipped values."""
        return silos * 2.0 ** -(self.frac_bits if self.stochastic else self.frac_bits + 1)


def _fits(field: Field, frac_bits: int, silos: int, bits: int) -> bool:
    return silos * math.ceil(field.bound * 2**frac_bits) < _LIMITS[bits]


def choose_encoding(field: Field, silos: int) -> FieldEncoding:
    """The narrowest words, at the highest precision up to the field's own, for a sum of `silos` values."""
    own = field.frac_bits
    if _fits(field, own, silos, 32):
        return FieldEncoding(field, 32, own, stochastic=False)
    if field.sensitivity == 0:
        lowered = next(
            (f for f in range(own - 1, NARROW_MIN_FRAC_BITS - 1, -1) if _fits(field, f, silos, 32)), None
        )
        if lowered is not None:
            return FieldEncoding(field, 32, lowered, stochastic=True)
    if _fits(field, own, silos, 64):
        return FieldEncoding(field, 64, own, stochastic=False)
    raise OverflowRisk(
        f"sums of {silos} silos could overflow 64 bits in {field.name} (bound {field.bound:g}, {own} "
        "fractional bits); lower the bounds, the precision or the number of silos"
    )


def rounding_key(values: np.ndarray) -> bytes:
    """The stochastic rounding's key for `values` (contiguous float64): SHA-256 of the label, the length and
    the column and row sums of the values' 64-bit words in rows of `KEY_ROW` (module docstring)."""
    words = values.view(np.uint64)
    rows = len(words) // KEY_ROW
    grid, tail = words[: rows * KEY_ROW].reshape(rows, KEY_ROW), words[rows * KEY_ROW :]
    columns = grid.sum(axis=0, dtype=np.uint64)
    columns[: len(tail)] += tail
    row_sums = np.append(grid.sum(axis=1, dtype=np.uint64), tail.sum(dtype=np.uint64))
    digest = hashlib.sha256(ROUNDING_KEY + len(words).to_bytes(8, "little"))
    digest.update(columns.astype("<u8", copy=False).tobytes())
    digest.update(row_sums.astype("<u8", copy=False).tobytes())
    return digest.digest()


def _round_stochastic(scaled: np.ndarray, uniforms: np.ndarray, frac_bits: int, rng: SecureRandom) -> None:
    """scaled ← ⌊scaled · 2^f + w · 2^−16⌋ in place, w the stream's next 16-bit words (as floats in
    `uniforms`, a scratch of the same length), computed as (scaled · 2^(f+16) + w) · 2^−16: scaling by powers
    of two is exact, so only the sum rounds (module docstring)."""
    np.copyto(uniforms, rng.words((len(scaled) + 3) // 4).view("<u2")[: len(scaled)])
    scaled *= 2.0 ** (frac_bits + UNIFORM_BITS)
    scaled += uniforms
    scaled *= 2.0**-UNIFORM_BITS
    np.floor(scaled, out=scaled)


def _encode_field(
    e: FieldEncoding, values: np.ndarray, words: np.ndarray, scratch: np.ndarray, rng: SecureRandom | None
) -> None:
    """words ← the field's values clipped, scaled and rounded, a block at a time in the two rows of
    `scratch`, so that each step reads the values once and works in cache (whole-vector temporaries cost
    more in page faults and memory traffic than the arithmetic). Blocks are a multiple of four values, so
    the stochastic rounding reads its field's stream words whole and in order."""
    for start in range(0, len(values), ENCODE_BLOCK):
        block = values[start : start + ENCODE_BLOCK]
        scaled, uniforms = scratch[:, : len(block)]
        np.clip(block, -e.field.bound, e.field.bound, out=scaled)
        if e.stochastic:
            _round_stochastic(scaled, uniforms, e.frac_bits, rng)
        else:
            scaled *= 2.0**e.frac_bits
            np.rint(scaled, out=scaled)
        words[start : start + len(block)] = scaled


class FixedPointCodec:
    def __init__(self, schema: Schema, *, max_silos: int) -> None:
        if max_silos < 1:
            raise ValueError(f"need max_silos >= 1, got {max_silos}")
        self.schema, self.silos = schema, max_silos
        self.encodings = tuple(choose_encoding(f, max_silos) for f in schema.fields)
        wide = sum(e.field.size for e in self.encodings if e.bits == 64)
        self.ring = Ring(wide, schema.size - wide)
        # each field's place: its slice of the flat vector, its part of the ring (0 wide, 1 narrow) and offset
        self._places: list[tuple[FieldEncoding, slice, int, int]] = []
        start, offsets = 0, [0, 0]
        for e in self.encodings:
            part = 0 if e.bits == 64 else 1
            self._places.append((e, slice(start, start + e.field.size), part, offsets[part]))
            start += e.field.size
            offsets[part] += e.field.size

    def error_bound(self, name: str) -> float:
        """The most the decoded sum of field `name` is off from the sum of the silos' clipped values."""
        return next(e for e in self.encodings if e.field.name == name).error_bound(self.silos)

    def encode(self, vector: torch.Tensor, rng: SecureRandom | None = None) -> np.ndarray:
        """A flat float vector in schema order as a ring vector (values beyond their bounds are clipped).
        `rng` draws the stochastic rounding's uniforms, if any field needs them: by default a stream keyed
        with `rounding_key` of the vector."""
        values = np.ascontiguousarray(vector.detach().cpu().numpy(), dtype=np.float64)
        if values.shape != (self.schema.size,):
            raise ValueError(f"vector of shape {values.shape}, the schema needs {(self.schema.size,)}")
        if not np.isfinite(values).all():
            raise ValueError("cannot encode non-finite values")
        out = self.ring.zeros()
        parts = [p.view(np.int64 if p.dtype.itemsize == 8 else np.int32) for p in self.ring.parts(out)]
        scratch = np.empty((2, min(ENCODE_BLOCK, len(values))))
        for e, where, part, offset in self._places:
            if e.stochastic and rng is None:
                rng = SecureRandom(rounding_key(values))
            _encode_field(e, values[where], parts[part][offset : offset + e.field.size], scratch, rng)
        return out

    def decode(self, vector: np.ndarray) -> torch.Tensor:
        """A sum of encodings (added in the ring) back to floats, in schema order."""
        parts = [p.view(np.int64 if p.dtype.itemsize == 8 else np.int32) for p in self.ring.parts(vector)]
        out = np.empty(self.schema.size, dtype=np.float64)
        for e, where, part, offset in self._places:
            np.divide(parts[part][offset : offset + e.field.size], 2.0**e.frac_bits, out=out[where])
        return torch.from_numpy(out)


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
