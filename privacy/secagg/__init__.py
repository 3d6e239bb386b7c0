"""Secure aggregation (Bonawitz et al., CCS 2017; SecAgg+, Bell et al., CCS 2020): the `secagg` layer.

`protocol` is the transport-free core (sessions, silo client, aggregator server); `shamir` is its primitive,
with the shared `privacy.ring` (fixed-point codec, masks) and `privacy.crypto`; `settings` holds the session
the consortium proposes and a silo's minimums; `layer` runs it all in one process for the simulator, `local`
for tests; `wire` connects it to the consortium's Protobuf messages, and `privacy.peers` to certificates. The
tail guard is layer-independent (`fedlt.aggregation.tail_guard`).
"""
