"""The `blind` layer's messages on the consortium's wire: secagg's, and three of its own.

Every stage of its census and contribution is a secagg stage, carried as secagg carries it. The total handed
back after the unmask stage is as large as an upload, too large for the directive stream: its `SumStep` only
announces it (`TotalReady`: its size and SHA-256) and each silo fetches it through the FetchSum RPC
(`fetch_total`), reading no more than announced and checking the hash. The evaluation sum's masked counts and
their total are small dataclass messages on the generic codec (`fedlt.wire.codec`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from fedlt.wire import fetch_announced
from fedlt.wire.codec import encode
from privacy.blind.halves import BlindTotal
from privacy.secagg import wire as secagg

READY_TYPE = "blind.TotalReady"


@dataclass(frozen=True)
class TotalReady:
    """A SumStep's announcement of a blind total, before the silo has fetched it."""

    total_bytes: int
    sha256: str


def ready_to_pb(step: BlindTotal) -> dict[str, object]:
    ready = TotalReady(len(step.total), hashlib.sha256(step.total).hexdigest())
    return {"layer": encode(ready, READY_TYPE)}


def fetch_total(stub, round_id: str, purpose: str, ready: TotalReady, timeout: float) -> BlindTotal:
    data = fetch_announced(
        stub, round_id, purpose, total_bytes=ready.total_bytes, sha256=ready.sha256, timeout=timeout
    )
    return BlindTotal(data)


WIRE = replace(
    secagg.WIRE,
    step_encoders={**secagg.WIRE.step_encoders, BlindTotal: ready_to_pb},
    fetchers={TotalReady: fetch_total},
)
