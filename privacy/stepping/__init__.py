"""What a layer needs when only silos can read its sums, so they, not the aggregator, step the model.

`ckks` is the one such layer today. `sealed_state` seals the state silos step to under a key every silo
derives from the consortium's shared secret, so the aggregator keeps it without reading it; `attestation` has
every silo that steps sign the state's digest, and refuses a state that not every silo its sum counted signed;
`masks` hides what silos release after reading a sum behind zero-sum pairwise masks. Each takes the shared
secret as a `SharedKey`, and none depends on a layer.
"""

from __future__ import annotations

from typing import Protocol


class SharedKey(Protocol):
    """A secret every silo of the consortium holds and the aggregator lacks (under ckks, the secret context,
    `privacy.ckks.keys.SecretContext`): `context_id` names it, `derived_key` gives a key for one purpose."""

    context_id: str

    def derived_key(self, purpose: bytes) -> bytes: ...
