"""Secure aggregation (Bonawitz et al., CCS 2017): the primitives the protocol is built from.

`prg` expands a 256-bit seed into a mask, `shamir` splits and rebuilds seeds, `codec` maps a schema's float
fields into Z_2^64, where masks cancel by wrap-around.
"""
