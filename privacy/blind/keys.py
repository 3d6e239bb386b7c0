"""The output key every silo holds and the aggregator never does, and the output masks drawn from it.

One silo (the key holder) makes the key, 32 random bytes, and the key service seals it to every other silo
(`privacy.keyservice.ceremony`), as it does ckks's. Made by one silo rather than jointly: every silo ends up
holding the whole key anyway (each must remove every survivor's mask), so a joint coin toss would stop only a
key holder who picks a key it already knows, and that silo could hand its key to the aggregator whatever the
key was: the aggregator with one silo reads the sums either way, which is the layer's stated bound. The key's
public part is empty (`public_bytes`): the aggregator holds nothing of it.

An output mask is a keystream of the ring (`privacy.ring.apply_masks`, AES-128-CTR) whose seed is an HMAC
under a key derived from the output key, over the sum (round id, purpose, binding), the session's key list
(fresh per attempt: every silo advertises new keys) and the silo. The aggregator's sum of masked inputs
therefore carries one uniform mask per survivor; each silo removes all of them for the survivors it signed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.crypto import transcript
from privacy.ring import Ring, apply_masks

KEY_BYTES = 32
MASK_INFO = b"fedlt/blind/output-mask/v1"


class OutputKey:
    """The consortium's output-mask key: what each silo keeps in its state directory (0600, by the key
    service), never the aggregator."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) != KEY_BYTES:
            raise ValueError(f"an output key has {KEY_BYTES} bytes, got {len(raw)}")
        self._raw = bytes(raw)
        self.context_id = hashlib.sha256(b"fedlt/blind/key-id/v1" + self._raw).hexdigest()
        self._derived: dict[bytes, bytes] = {}

    @classmethod
    def new(cls) -> OutputKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_secret_bytes(cls, raw: bytes) -> OutputKey:
        return cls(raw)

    def secret_bytes(self) -> bytes:
        return self._raw

    def public_bytes(self) -> bytes:
        return b""

    def derived_key(self, purpose: bytes) -> bytes:
        """A 32-byte key for `purpose` (output masks, sealing states, release masks), HKDF-SHA256 bound to the
        key's id."""
        if purpose not in self._derived:
            hkdf = HKDF(hashes.SHA256(), length=32, salt=None, info=purpose + self.context_id.encode())
            self._derived[purpose] = hkdf.derive(self._raw)
        return self._derived[purpose]


class Withheld:
    """What the aggregator holds of the output key: nothing, once the key holder said it shared one."""


def read_public(raw: bytes) -> Withheld:
    """The aggregator's reading of the key's public part, which must be empty: a key holder that handed the
    aggregator any bytes as `public` would be handing it the key."""
    if raw:
        raise ValueError("the blind layer's key has no public part; the aggregator takes no bytes of it")
    return Withheld()


def mask_seed(key: OutputKey, sum_id: bytes, silo: str) -> bytes:
    """The seed of `silo`'s output mask in the sum `sum_id` (`sum_label`)."""
    return hmac.new(key.derived_key(MASK_INFO), transcript(sum_id, silo), hashlib.sha256).digest()


def sum_label(round_id: str, purpose: str, binding: bytes, keys_digest: bytes = b"") -> bytes:
    """Everything an output mask is bound to: a mask is never reused for another input of the same silo."""
    return transcript("fedlt/blind/sum/v1", round_id, purpose, binding, keys_digest)


def add_mask(ring: Ring, vector: np.ndarray, key: OutputKey, sum_id: bytes, me: str) -> None:
    """vector ← vector + this silo's output mask, in place."""
    apply_masks(ring, vector, [(mask_seed(key, sum_id, me), False)])


def remove_masks(ring: Ring, total: np.ndarray, key: OutputKey, sum_id: bytes, silos: Iterable[str]) -> None:
    """total ← total − the output mask of each of `silos`, in place: the sum over exactly them, unmasked."""
    apply_masks(ring, total, [(mask_seed(key, sum_id, u), True) for u in silos])
