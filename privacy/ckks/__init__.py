"""CKKS homomorphic encryption (TenSEAL): the `ckks` privacy layer.

`keys` holds the consortium's CKKS key as two types, the secret context silos keep and the public one the
aggregator adds with; `ceremony` moves the secret context from the silo that made it to every other silo,
sealed to each one's enrollment key; `halves` is the layer's two halves, with the consistency step that lets
a silo decrypt only a sum every silo it counts signed; `masks` hides what silos release after decrypting;
`sealed_state` and `attestation` keep the state silos step to sealed, and signed by every silo that computed
it; `layer` makes the halves for the simulator and the consortium; `wire` puts its messages on the
consortium's wire.
"""
