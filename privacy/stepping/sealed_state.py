"""The consortium's state when silos step the model, sealed by them so the aggregator keeps it unread.

Under a layer whose sums only silos can read (ckks: only silos hold the CKKS secret key), only they can step
the model; the aggregator stores what they report and streams it to the next round's silos. The sealing key is
derived from the consortium's shared secret (`SharedSecret.derived_key`: HKDF-SHA256 from the secret context
under ckks), so every silo that holds it can open what any other sealed; ChaCha20-Poly1305 binds the
consortium, the round and the state digest, so the aggregator can neither alter a state nor pass one round's
state off as another's. A seal says only that some holder of the key made it, any state under any digest:
that the silos a sum counted all computed it is what their signatures show (`attestation`).
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fedlt.aggregation.registry import SharedSecret
from fedlt.errors import FedltError
from privacy.crypto import transcript

# named for ckks, the first layer to use it: a domain separator, so a new name would change every sealed state
STATE_INFO = b"fedlt/ckks/state-key/v1"
NONCE = 12


class SealedStateError(FedltError):
    """A sealed state that does not open with this silo's key for the round and digest named."""


def _aead(secret: SharedSecret) -> ChaCha20Poly1305:
    return ChaCha20Poly1305(secret.derived_key(STATE_INFO))


def seal_state(
    secret: SharedSecret, *, consortium: str, round_number: int, digest: str, packed: bytes
) -> bytes:
    nonce = os.urandom(NONCE)
    aad = transcript(consortium, str(round_number), digest)
    return nonce + _aead(secret).encrypt(nonce, packed, aad)


def open_state(
    secret: SharedSecret, *, consortium: str, round_number: int, digest: str, sealed: bytes
) -> bytes:
    aad = transcript(consortium, str(round_number), digest)
    try:
        return _aead(secret).decrypt(sealed[:NONCE], sealed[NONCE:], aad)
    except (InvalidTag, ValueError):
        raise SealedStateError(
            f"the state of round {round_number} does not open with key {secret.context_id[:16]} for digest "
            f"{digest[:16]}"
        ) from None
