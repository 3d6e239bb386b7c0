"""The consortium's state in ckks mode, sealed by silos so the aggregator keeps it without reading it.

Only silos hold the CKKS secret key, so only they can step the model; the aggregator stores what they report
and streams it to the next round's silos. The sealing key is derived from the secret context (HKDF-SHA256), so
every silo that holds the consortium's key can open what any other sealed; ChaCha20-Poly1305 binds the
consortium, the round and the state digest, so the aggregator can neither alter a state nor pass one round's
state off as another's. A seal says only that some holder of the key made it, any state under any digest:
that the silos a sum counted all computed it is what their signatures show (`attestation`).
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fedlt.errors import FedltError
from privacy.ckks.keys import SecretContext
from privacy.secagg.crypto import transcript

STATE_INFO = b"fedlt/ckks/state-key/v1"
NONCE = 12


class SealedStateError(FedltError):
    """A sealed state that does not open with this silo's key for the round and digest named."""


def _aead(secret: SecretContext) -> ChaCha20Poly1305:
    return ChaCha20Poly1305(secret.derived_key(STATE_INFO))


def seal_state(
    secret: SecretContext, *, consortium: str, round_number: int, digest: str, packed: bytes
) -> bytes:
    nonce = os.urandom(NONCE)
    aad = transcript(consortium, str(round_number), digest)
    return nonce + _aead(secret).encrypt(nonce, packed, aad)


def open_state(
    secret: SecretContext, *, consortium: str, round_number: int, digest: str, sealed: bytes
) -> bytes:
    aad = transcript(consortium, str(round_number), digest)
    try:
        return _aead(secret).decrypt(sealed[:NONCE], sealed[NONCE:], aad)
    except (InvalidTag, ValueError):
        raise SealedStateError(
            f"the state of round {round_number} does not open with key {secret.context_id[:16]} for digest "
            f"{digest[:16]}"
        ) from None
