"""One door to the aggregator at the silo: only `silo.transport` calls the consortium's service.

The agent's parts, the round's sums, the server step and the key service are handed a `SiloTransport`; a
module that called a stub itself would be a second way to the wire, with its own timeouts and its own
message mapping (`silo/stepping.py` once called `ReportState` and `ReportEvaluation` itself).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedlt.v1 import consortium_pb2 as pb
from silo.transport import CALL_TIMEOUT, SiloTransport

ROOT = Path(__file__).resolve().parent.parent
RPCS = {method.name for method in pb.DESCRIPTOR.services_by_name["ConsortiumService"].methods}
STUB_CALLERS = {"silo/transport.py"}  # the one door
CHANNEL_MAKERS = {"silo/connection.py"}  # the session: it opens the channel and makes the stub
# what maps a message to its RPC and calls the stub with it: for the transport alone
WIRE_CALLS = {"send", "fetched"}


def silo_modules() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in ROOT.glob("silo/*.py"))


def stub_calls(path: str) -> list[str]:
    """The RPCs of the consortium's service that a module calls by name, and the `privacy.wire` calls that
    take a stub."""
    tree = ast.parse((ROOT / path).read_text())
    called = [
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RPCS
    ]
    wire = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "privacy.wire"
        for alias in node.names
        if alias.name in WIRE_CALLS
    ]
    return called + wire


def stub_makers(path: str) -> list[str]:
    tree = ast.parse((ROOT / path).read_text())
    return [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "ConsortiumServiceStub"
    ]


@pytest.mark.parametrize("path", silo_modules())
def test_no_silo_module_but_the_transport_calls_the_aggregator(path):
    if path not in STUB_CALLERS:
        assert stub_calls(path) == [], f"{path} calls the aggregator past silo.transport"
    if path not in CHANNEL_MAKERS:
        assert stub_makers(path) == [], f"{path} makes a stub of its own"


def test_the_guard_sees_the_transports_calls():
    assert {"Register", "Join", "FetchState", "Refuse", "ReportState", "FetchKey"} <= set(
        stub_calls("silo/transport.py")
    )
    assert stub_makers("silo/connection.py") == ["ConsortiumServiceStub"]


class Recording:
    """The aggregator's end of a session, remembering each call with its timeout."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, float | None]] = []

    def __getattr__(self, rpc: str):
        def call(request, timeout=None):
            self.calls.append((rpc, request, timeout))

        return call


def test_every_call_but_the_directive_stream_is_bounded():
    stub = Recording()
    transport = SiloTransport(stub)
    transport.join(3)
    transport.refuse("r1.a1.x", code=pb.REFUSAL_CODE_POLICY, text="not allowed")
    transport.report_evaluation(1, correct=[1, 2], total=[3, 4])
    header = pb.StateReportHeader(round_id="r1.a1.x", total_bytes=5)
    transport.report_state(header, b"12345")
    (join, refuse, evaluation, report) = stub.calls
    assert (join[0], join[1].last_round, join[2]) == ("Join", 3, None)
    assert (refuse[0], refuse[1].code, refuse[1].text, refuse[2]) == (
        "Refuse",
        pb.REFUSAL_CODE_POLICY,
        "not allowed",
        CALL_TIMEOUT,
    )
    assert (list(evaluation[1].correct), list(evaluation[1].total), evaluation[2]) == (
        [1, 2],
        [3, 4],
        CALL_TIMEOUT,
    )
    parts = list(report[1])
    assert parts[0].header == header
    assert b"".join(part.chunk for part in parts[1:]) == b"12345"
    assert report[2] == CALL_TIMEOUT
