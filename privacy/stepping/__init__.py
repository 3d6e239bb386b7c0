"""What a layer needs when only silos can read its sums, so they, not the aggregator, step the model.

`ckks` is the one such layer today. `sealed_state` seals the state silos step to under a key every silo
derives from the consortium's shared secret, so the aggregator keeps it without reading it; `attestation` has
every silo that steps sign the state's digest, and refuses a state that not every silo its sum counted signed;
`masks` hides what silos release after reading a sum behind zero-sum pairwise masks. Each takes the shared
secret the key service holds (`fedlt.aggregation.registry.SharedSecret`), and none depends on a layer.
"""
