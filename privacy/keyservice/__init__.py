"""The key service: a runtime capability for a layer whose consortium shares one secret key (ckks, today).

A layer asks for it in its record (`fedlt.aggregation.registry.KeyKind`: how its key is made and read); the
silo and the aggregator provide it (`silo.key_service`, `aggregator.key_service`), naming no layer. One silo,
the key holder, makes the key; `ceremony` seals it to every other silo through the aggregator, which relays
envelopes it cannot open and keeps only the key's public part; `wire` puts the ceremony's messages on the
consortium's wire; `relay` is what a layer's aggregator side reads of the relay, and the refusal of a sum
before the key has reached a silo.
"""
