"""`python -m aggregator status`: the operator's view of a running aggregator, over mutual TLS; `ask` makes
every operator's call (`status`, `study ...`) and says in one line why one has no answer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from aggregator.config import ConsortiumConfig, load_consortium_config
from aggregator.server import LISTENING
from aggregator.status_page import standing as study_standing
from fedlt.errors import FedltError
from fedlt.v1 import operator_pb2, operator_pb2_grpc

WILDCARDS = ("0.0.0.0", "::", "")
STUDY_COLUMNS = ("study", "method over privacy", "rounds", "state")
CALL_SECONDS = 30.0


class NoAnswer(Exception):
    """An operator's call the aggregator refused, or that no aggregator answered: the message says which, in
    one line (the problems of a study file follow it, one a line). The command exits 1."""


def show_status(
    config_path: str | Path,
    *,
    cert: str | Path,
    key: str | Path,
    address: str | None = None,
    study: str = "",
) -> int:
    config = load_consortium_config(config_path)
    request = operator_pb2.StatusRequest(study=study)
    status = ask(config, "Status", request, cert=cert, key=key, address=address)
    print(render(status, dp=status.dp_enabled))
    return 0


def ask(
    config: ConsortiumConfig,
    rpc: str,
    request: Message,
    *,
    cert: str | Path,
    key: str | Path,
    address: str | None = None,
) -> Any:
    """The aggregator's answer to one `OperatorService` call made with the operator's certificate; NoAnswer
    where there is none. `address`: where to dial (default: where the aggregator bound, or its listen)."""
    address = address or _bound_address(config)
    host = address.rpartition(":")[0].strip("[]")
    if host in WILDCARDS:
        raise FedltError(
            f"the aggregator listens on every interface ({address}); give --address with the host name or "
            "address the silos dial (its certificate names it), e.g. --address aggregator.example.org:50051"
        )
    credentials = grpc.ssl_channel_credentials(
        root_certificates=config.path(config.server.ca).read_bytes(),
        private_key=_read(key, "--key"),
        certificate_chain=_read(cert, "--cert"),
    )
    with grpc.secure_channel(address, credentials) as channel:
        try:
            return getattr(operator_pb2_grpc.OperatorServiceStub(channel), rpc)(request, timeout=CALL_SECONDS)
        except grpc.RpcError as exc:
            raise NoAnswer(_why(exc, address)) from None


def _read(path: str | Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FedltError(f"{option} {path}: {exc.strerror.lower() if exc.strerror else exc}") from None


def _why(exc: grpc.RpcError, address: str) -> str:
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"no aggregator answers at {address}: is it running? (it stops after the last round unless "
            "[consortium] exit_when_done = false; the store's history stays in its data_dir)"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return (
            f"{address} refused this certificate: {details}; the operator's commands need an operator "
            "certificate (python -m aggregator ca issue-operator)"
        )
    return f"{address}: {code.name}: {details}"


def _bound_address(config) -> str:
    """The address the aggregator wrote when it bound (on its own machine), else `[server] listen`."""
    listening = config.path(config.server.data_dir) / LISTENING
    return json.loads(listening.read_text())["address"] if listening.exists() else config.server.listen


def render(status: operator_pb2.StatusResponse, *, dp: bool = True) -> str:
    """`dp`: whether the plan enables [dp]. Without it a silo's reported ε left is its lifetime budget, which
    this study does not spend, so the column says "no DP" rather than a number that reads as this study's."""
    now = time.time() * 1000
    lines = [
        f"consortium {status.consortium_id!r}, study {status.study!r}: {status.method} over {status.privacy}",
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
    if status.studies:
        lines += ["", "studies:", *(f"  {line}" for line in studies_table(status.studies))]
    return "\n".join(lines)


def studies_table(studies: Iterable[operator_pb2.Study]) -> list[str]:
    """One row a study: its id, method over privacy, rounds committed of planned, and where it stands."""
    rows = [
        (
            f"{s.id} (default)" if s.is_default else s.id,
            f"{s.method or '-'} over {s.privacy or '-'}",
            f"{s.committed_rounds}/{s.total_rounds}",
            standing(s),
        )
        for s in studies
    ]
    wide = [max(len(row[k]) for row in [STUDY_COLUMNS, *rows]) for k in range(3)]
    return [
        f"{name:<{wide[0]}}  {layers:<{wide[1]}}  {rounds:>{wide[2]}}  {state}"
        for name, layers, rounds, state in [STUDY_COLUMNS, *rows]
    ]


def standing(study: operator_pb2.Study) -> str:
    """A study's state, with its place in the queue or the reason it is in that state."""
    return study_standing(study.state, _printable(study.reason), study.queue_position)


def _refusal_line(refusal: operator_pb2.SiloRefusal) -> str:
    """Under a silo's row: the attempt it refused and why, as the silo put it (one line, escaped)."""
    return f"  └ refused {refusal.round_id}: {refusal.code}: {_printable(refusal.text)}"


def _printable(text: str) -> str:
    """`text` as one line on a terminal: what a silo or an error wrote carries no control sequences."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _epsilon_left(silo: operator_pb2.SiloStatus, dp: bool) -> str:
    if not dp:
        return "no DP"
    return f"{silo.privacy_remaining:.3g}" if silo.HasField("privacy_remaining") else "-"  # the silo's choice
