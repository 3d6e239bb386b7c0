"""A whole secure-aggregation session in one process: the simulator's secure sum, and the tests' harness.

Every silo runs its real `SecAggClient` and the aggregator its real `SecAggServer`; only the network is
missing. Dropouts are named by the stage a silo never answers, so a test can stop any silo at any stage. In a
sum silos recompute (the census), every silo that revealed recomputes it from the aggregator's transcript.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

from privacy.peers import KeyPeers
from privacy.pki.signing import sign
from privacy.secagg.protocol import ProtocolViolation, SecAggClient, SecAggServer, SessionSpec

STAGES = ("keys", "shares", "masked", "consistency", "unmask")


def run_session(
    spec: SessionSpec, inputs: Mapping[str, np.ndarray], *, dropouts: Mapping[str, str] | None = None
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Σ of the inputs of the silos that sent a masked input (U3), and U3; raises as the protocol does.

    `dropouts` maps a silo to the first stage it does not answer (one of `STAGES`). In a sum silos
    recompute, every silo that revealed recomputes it from the transcript; one that gets another sum than
    the aggregator's raises `ProtocolViolation`, as it would refuse the aggregator's count in a round.
    """
    dropouts = dropouts or {}
    unknown = {stage for stage in dropouts.values() if stage not in STAGES}
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; stages are {STAGES}")
    identities = {u: ec.generate_private_key(ec.SECP256R1()) for u in spec.participants}
    peers = KeyPeers({u: key.public_key() for u, key in identities.items()})
    clients = {
        u: SecAggClient(
            spec, u, sign=lambda data, *, context, key=key: sign(key, data, context=context), peers=peers
        )
        for u, key in identities.items()
    }
    server = SecAggServer(spec, peers=peers)

    def answering(stage: str, among: tuple[str, ...]) -> list[str]:
        return [u for u in among if u not in dropouts or STAGES.index(dropouts[u]) > STAGES.index(stage)]

    for u in answering("keys", spec.participants):
        server.add_keys(u, clients[u].advertise())
    advertised = server.close_keys()
    for u in answering("shares", server.u1):
        server.add_envelopes(u, clients[u].share(advertised))
    inboxes = server.close_shares()
    for u in answering("masked", server.u2):
        server.add_masked(u, clients[u].masked_input(inboxes[u], inputs[u]), clients[u].masked_signature)
    survivors = server.close_masked()
    for u in answering("consistency", survivors):
        server.add_signature(u, clients[u].consistency(survivors))
    signatures = server.close_consistency()
    revealed = answering("unmask", server.u4)
    for u in revealed:
        server.add_reveal(u, clients[u].unmask(signatures))
    total = server.close_unmask()
    if spec.recomputed:
        transcript = server.transcript()
        server.close_transcript()
        if any(not np.array_equal(clients[u].recompute(transcript), total) for u in revealed):
            raise ProtocolViolation("a silo recomputed another sum than the aggregator's")
    return total, survivors
