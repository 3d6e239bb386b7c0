"""Zero-sum masks on what silos release after reading a sum (their evaluation counts), from the shared key.

Under ckks the consistency step (`privacy.ckks.halves`) shows a silo that every silo it counts was handed the
same ciphertext, not that the ciphertext is their sum: the aggregator could hand all of them one silo's
upload. For a sum whose total a silo then releases raw, every silo adds a pairwise mask for each other silo
of the sum (+m at one end, −m at the other), drawn from a key derived from the consortium's shared secret
(`SharedSecret`: the CKKS secret key under ckks), which the aggregator lacks. The masks cancel only in the sum
over exactly those silos; any other sum (under ckks, any other ciphertext) reads as values plus masks of up to
±`MASK_RANGE` each, which are no counts (the releasing silo refuses them) and would hide the counts if it did
not.

`sum_id` must name everything the released values depend on that the aggregator could vary between sums
over the same silos: the evaluation's is bound to the state the silo stepped to (`silo.stepping`), so masks
drawn by silos that stepped to different models never cancel, and a model forced on some silos cannot turn
the others' masked counts into one silo's.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import numpy as np

from fedlt.aggregation.registry import SharedSecret
from privacy import ring
from privacy.crypto import transcript

# named for ckks, the first layer to use it: a domain separator, so a new name would change every mask
MASK_INFO = b"fedlt/ckks/release-mask/v1"
MASK_RANGE = 2**24


def zero_sum_mask(secret: SharedSecret, sum_id: str, me: str, silos: Sequence[str], size: int) -> np.ndarray:
    """This silo's mask for the sum `sum_id` over `silos`: the masks of all of them add up to zero."""
    key, total = secret.derived_key(MASK_INFO), np.zeros(size, dtype=np.int64)
    members = transcript(*sorted(silos))  # a pair's mask in one set never cancels one of another set
    for other in silos:
        if other == me:
            continue
        low, high = sorted((me, other))
        seed = hmac.new(key, transcript(sum_id, members, low, high), hashlib.sha256).digest()
        words = ring.mask(seed, size) % np.uint64(2 * MASK_RANGE + 1)
        pair = words.astype(np.int64) - MASK_RANGE
        total += pair if me == low else -pair
    return total.astype(np.float64)
