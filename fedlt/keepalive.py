"""gRPC keepalive pings on both ends of a silo's connection.

A link can stop carrying packets without closing: a NAT or firewall that forgot the flow, a cable pulled
between two routers. Neither end of such a half-open connection hears anything, ever: the silo waits for its
next directive and the aggregator keeps counting it as present and invites it to rounds it never sees (the
fault-injection test's stalled links did exactly that until pings were on). With pings, each end drops a
link whose peer has not answered within `seconds` of a ping sent after `seconds` of silence; the silo then
reconnects and the aggregator stops waiting for it.
"""

from __future__ import annotations

MIN_SECONDS = 10.0  # the aggregator accepts a silo's pings this often (half of it, for clock jitter)


def _pings(seconds: float) -> list[tuple[str, int]]:
    ms = int(1000 * seconds)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def silo_options(seconds: float) -> list[tuple[str, int]]:
    """A silo's channel options: ping after `seconds` of silence, give up on the link after as many more."""
    return _pings(seconds)


def aggregator_options(seconds: float) -> list[tuple[str, int]]:
    """The server's options: ping silos likewise, and accept their pings down to every `MIN_SECONDS` / 2
    (gRPC's default refuses pings more often than every five minutes and closes the connection)."""
    return [
        *_pings(seconds),
        ("grpc.http2.min_ping_interval_without_data_ms", int(500 * MIN_SECONDS)),
        # gRPC sets SO_REUSEPORT by default: a second aggregator could bind the same port, and the two would
        # share the silos' connections, each stalling for the silos the other holds
        ("grpc.so_reuseport", 0),
    ]
