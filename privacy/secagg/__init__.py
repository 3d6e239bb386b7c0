"""Secure aggregation (Bonawitz et al., CCS 2017; SecAgg+, Bell et al., CCS 2020): the `secagg` layer.

`protocol` is the transport-free core (sessions, silo client, aggregator server); `prg`, `shamir`, `crypto`
and `codec` are its primitives; `policy` holds a silo's minimums; `layer` runs it all in one process for the
simulator, `local` for tests; `wire` and `peers` connect it to the consortium's Protobuf messages and
certificates. The tail guard is layer-independent (`fedlt.aggregation.tail_guard`).
"""
