"""`python -m aggregator status`: the operator's view of a running aggregator, over mutual TLS."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import grpc

from aggregator.config import load_consortium_config
from aggregator.server import LISTENING
from fedlt.errors import FedltError
from fedlt.v1 import operator_pb2, operator_pb2_grpc

WILDCARDS = ("0.0.0.0", "::", "")


def show_status(
    config_path: str | Path, *, cert: str | Path, key: str | Path, address: str | None = None
) -> int:
    config = load_consortium_config(config_path)
    address = address or _bound_address(config)
    host = address.rpartition(":")[0].strip("[]")
    if host in WILDCARDS:
        raise FedltError(
            f"the aggregator listens on every interface ({address}); give --address with the host name or "
            "address the silos dial (its certificate names it), e.g. --address aggregator.example.org:50051"
        )
    credentials = grpc.ssl_channel_credentials(
        root_certificates=config.path(config.server.ca).read_bytes(),
        private_key=Path(key).read_bytes(),
        certificate_chain=Path(cert).read_bytes(),
    )
    with grpc.secure_channel(address, credentials) as channel:
        try:
            status = operator_pb2_grpc.OperatorServiceStub(channel).Status(
                operator_pb2.StatusRequest(), timeout=10
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                print(
                    f"error: no aggregator answers at {address}: is it running? (it stops after the last "
                    "round unless [consortium] exit_when_done = false; the store's history stays in its "
                    "data_dir)",
                    file=sys.stderr,
                )
            else:
                print(f"error: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(render(status, dp=config.plan.dp.enabled))
    return 0


def _bound_address(config) -> str:
    """The address the aggregator wrote when it bound (on its own machine), else `[server] listen`."""
    listening = config.path(config.server.data_dir) / LISTENING
    return json.loads(listening.read_text())["address"] if listening.exists() else config.server.listen


def render(status: operator_pb2.StatusResponse, *, dp: bool = True) -> str:
    """`dp`: whether the plan enables [dp]. Without it a silo's reported ε left is its lifetime budget, which
    this study does not spend, so the column says "no DP" rather than a number that reads as this study's."""
    now = time.time() * 1000
    lines = [
        f"consortium {status.consortium_id!r}: {status.method} over {status.privacy}",
        f"rounds committed: {status.committed_rounds}/{status.total_rounds}   stage: {status.stage}",
        f"state digest: {status.state_digest[:16]}",
    ]
    if status.round_id:
        left = max(0.0, (status.stage_deadline_unix_ms - now) / 1000)
        lines.append(
            f"in flight: {status.round_id}, {len(status.submitted)}/{len(status.participants)} "
            f"contributions, deadline in {left:.0f} s"
        )
    header = (
        f"{'silo':<20} {'connected':<10} {'activity':<10} {'last seen':>10} {'last round':>10} {'ε left':>8}"
    )
    if status.certificate_warnings:
        lines += ["", "certificates:", *(f"  ! {w}" for w in status.certificate_warnings)]
    lines += ["", header]
    for s in status.silos:
        seen = f"{(now - s.last_seen_unix_ms) / 1000:.0f} s ago" if s.last_seen_unix_ms else "never"
        connected = "yes" if s.connected else "no"
        left = _epsilon_left(s, dp)
        activity = "refused" if s.HasField("refusal") else s.activity
        row = f"{s.silo_id:<20} {connected:<10} {activity:<10} {seen:>10} {s.last_contributed_round:>10}"
        lines.append(f"{row} {left:>8}")
        if s.HasField("refusal"):
            lines.append(_refusal_line(s.refusal))
    return "\n".join(lines)


def _refusal_line(refusal: operator_pb2.SiloRefusal) -> str:
    """Under a silo's row: the attempt it refused and why, as the silo put it (one line, escaped)."""
    said = "".join(c if c.isprintable() else "?" for c in refusal.text)  # no terminal control sequences
    return f"  └ refused {refusal.round_id}: {refusal.code}: {said}"


def _epsilon_left(silo: operator_pb2.SiloStatus, dp: bool) -> str:
    if not dp:
        return "no DP"
    return f"{silo.privacy_remaining:.3g}" if silo.HasField("privacy_remaining") else "-"  # the silo's choice
