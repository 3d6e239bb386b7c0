"""A TCP proxy on 127.0.0.1 that mistreats the traffic between silos and the aggregator, for fault injection.

Every chunk read from either side is delayed a little, and now and then by seconds (a message that arrives
after its stage closed). Every connection meets one mishap after a lifetime drawn at random: it is cut (both
sides closed); two of its chunks are swapped (TLS then fails the record and the connection dies, as behind a
broken middlebox); or it stalls for good without closing, a half-open link as behind a NAT that forgot the
flow, where neither end hears anything again. Kinds take turns, and each proxy meets its first mishap early,
so a short run meets every one. Each silo dials its own proxy, so independent delays also reorder messages
between silos. Draws come from seeded generators.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

CHUNK = 64 * 1024
MISHAPS = ("cut", "swap", "stall")


@dataclass(frozen=True)
class Chaos:
    delay: float = 0.02  # seconds, at most, before each chunk is forwarded
    late: float = 0.0  # chance, per chunk, of a delay of 1 to `late_seconds` instead
    late_seconds: float = 5.0
    lifetime: float = 60.0  # mean seconds before a connection meets its mishap


class ChaosProxy:
    def __init__(self, upstream: str, chaos: Chaos, rng: random.Random, mishaps: Iterator[str]) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.chaos = chaos
        self.rng = rng
        self.mishaps = mishaps  # shared by the proxies of one test, so that kinds take turns across them
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def turns() -> Iterator[str]:
        return itertools.cycle(MISHAPS)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                _close(s)

    def _delay(self) -> float:
        with self._lock:
            if self.rng.random() < self.chaos.late:
                self.counts["late"] += 1
                return self.rng.uniform(1.0, self.chaos.late_seconds)
            return self.rng.uniform(0.0, self.chaos.delay)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                continue  # closed, or the aggregator is down: the client sees its connection end
            server.settimeout(None)
            with self._lock:
                self.counts["connections"] += 1
                self._sockets += [client, server]
                lifetime = self._lifetime()
                link = _Link(client, server, time.monotonic() + lifetime)
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(link, source, target), daemon=True).start()

    def _lifetime(self) -> float:
        """Until this proxy's first mishap, a quarter to three quarters of the mean, so each proxy meets one
        early and three proxies taking turns meet every kind in any run longer than that (a fast run with
        exponential lifetimes alone once met two). Then exponential with the mean. Called under the lock."""
        if not any(self.counts[m] for m in MISHAPS):
            return self.rng.uniform(0.25, 0.75) * self.chaos.lifetime
        return self.rng.expovariate(1.0 / self.chaos.lifetime)

    def _due(self, link: _Link) -> str:
        """The link's mishap, once, when its time has come: the next kind in turn (to whichever direction sees
        it first; a connection that ends sooner, like a silo's TLS probe, takes no turn)."""
        with self._lock:
            if link.met or time.monotonic() < link.at:
                return ""
            link.met = mishap = next(self.mishaps)
            self.counts[mishap] += 1
        {"stall": link.stalled, "cut": link.cut}.get(mishap, threading.Event()).set()
        return mishap

    def _pump(self, link: _Link, source: socket.socket, target: socket.socket) -> None:
        held = b""
        try:
            while not self._closed.is_set():
                data = source.recv(CHUNK)
                if not data or link.cut.is_set():
                    break
                if link.stalled.is_set():
                    continue  # read and dropped: the sender hears nothing back
                mishap = self._due(link)
                if mishap == "stall":
                    continue
                if mishap == "cut":
                    break
                if mishap == "swap":
                    held = data
                    continue
                time.sleep(self._delay())
                target.sendall(data + held)
                held = b""
        except OSError:
            pass
        if not link.stalled.is_set():
            link.close()


class _Link:
    def __init__(self, client: socket.socket, server: socket.socket, at: float) -> None:
        self.sockets = (client, server)
        self.at, self.met = at, ""
        self.stalled, self.cut = threading.Event(), threading.Event()

    def close(self) -> None:
        for s in self.sockets:
            _close(s)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
