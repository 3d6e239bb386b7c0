"""CKKS homomorphic encryption (TenSEAL): the `ckks` privacy layer.

`keys` holds the consortium's CKKS key as two types, the secret context silos keep and the public one the
aggregator adds with; `ceremony` moves the secret context from the silo that made it to every other silo,
sealed to each one's enrollment key; `halves` is the layer's two halves; `layer` makes them for the
simulator and the consortium; `wire` puts its messages on the consortium's wire.
"""
