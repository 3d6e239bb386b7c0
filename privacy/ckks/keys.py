"""The consortium's CKKS key: parameters, the secret context silos keep, the public one the aggregator uses.

Parameters, for sums only (no multiplications, rotations or rescaling): polynomial degree N = 8192 (4,096
slots a ciphertext) and a coefficient modulus of two 60-bit primes, one for the data and one special prime.
120 bits is well under the 218 bits the HomomorphicEncryption.org standard allows at N = 8192 for 128-bit
classical security (SEAL enforces that table). A longer chain buys depth that additions never use, and every
extra prime adds 8 bytes per slot to every ciphertext. Encryption is symmetric: only silos, which hold the
secret key, make fresh ciphertexts, so the public context needs no public key (it is a few bytes) and a fresh
ciphertext carries less noise. No Galois or relinearisation keys are made. Symmetric encryption also lets an
upload travel seeded (`privacy.ckks.seeded`): 4× float32 where TenSEAL's own form takes 8×. The sum the
aggregator hands back is an ordinary ciphertext, at 8×.

The public context cannot decrypt, but it is no proof of what a ciphertext holds: it adds a plaintext of its
holder's choosing to any ciphertext (TenSEAL's add-plain needs no secret key), and subtracts one ciphertext
from another. So the aggregator can hand a silo the sum plus any P it likes as "the sum"; a silo decrypts
only once every silo it counts signed the same ciphertext (`halves`, the consistency step), and what it
releases after decrypting is masked (`privacy.stepping.masks`).

Values are encoded at a scale chosen per sum from the schema (`scale_bits`): the summed values must stay
below the 60-bit data prime, so the scale leaves room for n silos times the largest field bound. A sum whose
room would leave fewer than `MIN_SCALE_BITS` is refused, like an overflowing fixed-point range.

Secrets are their own type: `SecretContext` is the only one that can encrypt or decrypt, and it serializes
with its secret key only through `secret_bytes`, for sealing to another silo (`privacy.keyservice.ceremony`).
"""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import tenseal as ts
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlt.aggregation import Schema
from fedlt.aggregation.halves import SettingsRefused
from privacy.ckks.seeded import SeededEncryptor

POLY_MODULUS_DEGREE = 8192
SLOTS = POLY_MODULUS_DEGREE // 2
COEFF_MOD_BIT_SIZES = (60, 60)
DATA_BITS = 60
MAX_SCALE_BITS = 40
MIN_SCALE_BITS = 20


class CkksKeyError(ValueError):
    """Bytes that are not a context of the kind expected, or a ciphertext this context cannot read."""


class CkksOverflowRisk(SettingsRefused):
    """The schema's bounds times the silos leave too little room for a useful scale."""


def scale_bits(schema: Schema, silos: int) -> int:
    """Scale bits for summing `silos` vectors of `schema`: room for n times the largest bound, a bit spare."""
    room = DATA_BITS - 2 - math.ceil(math.log2(silos * max(f.bound for f in schema.fields)))
    bits = min(MAX_SCALE_BITS, room)
    if bits < MIN_SCALE_BITS:
        raise CkksOverflowRisk(
            f"a CKKS sum of {silos} silos with field bounds up to {max(f.bound for f in schema.fields):g} "
            f"leaves a scale of 2^{bits}, below 2^{MIN_SCALE_BITS}: lower the bounds or the silos"
        )
    return bits


def ciphertext_limit(values: int) -> int:
    """The most bytes an upload of `values` values may announce: per 4,096 values one seeded ciphertext (one
    polynomial of N 64-bit coefficients, the other sent as its seed) and a little framing. The same values
    in TenSEAL's expanded form take twice that, and are refused."""
    chunks = math.ceil(values / SLOTS)
    return chunks * (POLY_MODULUS_DEGREE * 8 + 1024) + 4096


class PublicContext:
    """What the aggregator holds: it adds and subtracts ciphertexts and adds a plaintext of its choosing to
    one; it cannot decrypt, nor encrypt a fresh ciphertext (encryption is symmetric)."""

    def __init__(self, context: ts.Context) -> None:
        if context.is_private():
            raise CkksKeyError("a public context holds no secret key")
        self._context = context
        self.serialized = context.serialize(
            save_secret_key=False, save_galois_keys=False, save_relin_keys=False
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> PublicContext:
        return cls(_context_from(raw, "public"))

    def add(self, ciphertexts: list[bytes]) -> bytes:
        total = self.read(ciphertexts[0])
        for blob in ciphertexts[1:]:
            total.add(self.read(blob))
        return total.serialize()

    def read(self, blob: bytes) -> Ciphertext:
        return Ciphertext.parse(self._context, blob)


class SecretContext:
    """What each silo keeps in its state directory: encrypts its uploads, decrypts the consortium's sums."""

    def __init__(self, context: ts.Context) -> None:
        if not context.is_private():
            raise CkksKeyError("a secret context holds the secret key")
        self._context = context
        self.public = PublicContext(ts.context_from(context.serialize(save_secret_key=False)))
        # names the key, not the parameters (a symmetric public context is the same for every key): the key
        # holder announces it, every silo checks the key it holds against the RoundSpec's
        self.context_id = hashlib.sha256(b"fedlt/ckks/key-id/v1" + self.secret_bytes()).hexdigest()
        self._derived: dict[bytes, bytes] = {}
        self._seeded = SeededEncryptor(context)

    @classmethod
    def new(cls) -> SecretContext:
        context = ts.context(
            ts.SCHEME_TYPE.CKKS,
            POLY_MODULUS_DEGREE,
            coeff_mod_bit_sizes=list(COEFF_MOD_BIT_SIZES),
            encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
        )
        return cls(context)

    @classmethod
    def from_secret_bytes(cls, raw: bytes) -> SecretContext:
        return cls(_context_from(raw, "secret"))

    def secret_bytes(self) -> bytes:
        """The context with its secret key: only ever sealed to another silo or written to a 0600 file."""
        return self._context.serialize(save_secret_key=True, save_galois_keys=False, save_relin_keys=False)

    def public_bytes(self) -> bytes:
        """The public context, which the key holder hands the aggregator (`PublicContext.from_bytes`)."""
        return self.public.serialized

    def derived_key(self, purpose: bytes) -> bytes:
        """A 32-byte key for `purpose` (sealing states, release masks), HKDF-SHA256 from the secret key and
        bound to its id; derived once per purpose, not on every round."""
        if purpose not in self._derived:
            info = purpose + self.context_id.encode()
            hkdf = HKDF(hashes.SHA256(), length=32, salt=None, info=info)
            self._derived[purpose] = hkdf.derive(self.secret_bytes())
        return self._derived[purpose]

    def encrypt(self, values: np.ndarray, *, scale_bits: int) -> bytes:
        """An upload: the values in ciphertexts of `SLOTS` each, seeded, in the layer's frame."""
        values = np.asarray(values, dtype=np.float64)
        chunks = (values[i : i + SLOTS] for i in range(0, len(values), SLOTS))
        return frame(self._seeded.encrypt(chunks, scale=2.0**scale_bits))

    def decrypt(self, blob: bytes, size: int) -> np.ndarray:
        ciphertext = Ciphertext.parse(self._context, blob)
        if ciphertext.size() != size:
            raise CkksKeyError(f"a ciphertext of {ciphertext.size()} values, where {size} were summed")
        return np.concatenate([np.asarray(c.decrypt(), dtype=np.float64) for c in ciphertext.chunks])


def _context_from(raw: bytes, kind: str) -> ts.Context:
    try:
        return ts.context_from(raw)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CkksKeyError(f"not a {kind} CKKS context: {exc}") from None


MAGIC = b"FCK1"


def frame(parts: list[bytes]) -> bytes:
    """The wire form of a vector as CKKS ciphertexts of at most `SLOTS` values each, every one a TenSEAL
    vector's bytes: b"FCK1", the count, then each with its length. (One TenSEAL vector spanning several
    ciphertexts works too, but prints a warning to stdout at every encryption.) One join of the whole frame:
    a ResNet-8 sum is 40 MB, and every extra copy shows."""
    out = [MAGIC, struct.pack("<I", len(parts))]
    for part in parts:
        out += [struct.pack("<I", len(part)), part]
    return b"".join(out)


class Ciphertext:
    """A vector as TenSEAL vectors of at most `SLOTS` values each, read from or written to its frame."""

    def __init__(self, chunks: list[ts.CKKSVector]) -> None:
        self.chunks = chunks

    def size(self) -> int:
        return sum(c.size() for c in self.chunks)

    def add(self, other: Ciphertext) -> Ciphertext:
        """Add `other` into this ciphertext, in place (a running sum owns its chunks), and return it."""
        if [c.size() for c in self.chunks] != [c.size() for c in other.chunks]:
            raise CkksKeyError("ciphertexts of different shapes cannot be added")
        for mine, theirs in zip(self.chunks, other.chunks, strict=True):
            mine.add_(theirs)
        return self

    def serialize(self) -> bytes:
        return frame([chunk.serialize() for chunk in self.chunks])

    @classmethod
    def parse(cls, context: ts.Context, blob: bytes) -> Ciphertext:
        """Seeded or expanded chunks alike: SEAL expands a seed as it loads, with no key."""
        try:
            if blob[:4] != MAGIC:
                raise ValueError("no ciphertext header")
            (count,) = struct.unpack_from("<I", blob, 4)
            offset, chunks = 8, []
            for _ in range(count):
                (length,) = struct.unpack_from("<I", blob, offset)
                chunks.append(ts.ckks_vector_from(context, blob[offset + 4 : offset + 4 + length]))
                offset += 4 + length
            if offset != len(blob) or not chunks:
                raise ValueError("trailing or missing bytes")
        except (ValueError, RuntimeError, TypeError, struct.error) as exc:
            raise CkksKeyError(f"not a ciphertext of this context: {exc}") from None
        return cls(chunks)
