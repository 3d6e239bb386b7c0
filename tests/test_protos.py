"""The committed stubs in fedlt/v1 must be what protoc generates from protos/ now."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_current(tmp_path):
    protos = sorted((ROOT / "protos" / "fedlt" / "v1").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *map(str, protos),
        ],
        check=True,
        timeout=120,
    )
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "fedlt" / "v1").iterdir())
    committed = sorted(
        p.relative_to(ROOT)
        for p in (ROOT / "fedlt" / "v1").iterdir()
        if p.name != "__init__.py" and p.suffix in {".py", ".pyi"}
    )
    assert generated == committed, "stub files differ from protos/: run `make protos`"
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"stale generated stubs (run `make protos`): {stale}"


def test_every_rpc_is_served():
    """The generated servicer bases answer UNIMPLEMENTED; ours must override every RPC of the contract."""
    from aggregator.service import ConsortiumServicer, OperatorServicer
    from fedlt.v1 import consortium_pb2, consortium_pb2_grpc, operator_pb2, operator_pb2_grpc

    for servicer, base, module, service in (
        (
            ConsortiumServicer,
            consortium_pb2_grpc.ConsortiumServiceServicer,
            consortium_pb2,
            "ConsortiumService",
        ),
        (OperatorServicer, operator_pb2_grpc.OperatorServiceServicer, operator_pb2, "OperatorService"),
    ):
        rpcs = [m.name for m in module.DESCRIPTOR.services_by_name[service].methods]
        assert rpcs
        missing = [name for name in rpcs if getattr(servicer, name) is getattr(base, name)]
        assert not missing, f"{servicer.__name__} leaves {missing} to the generated UNIMPLEMENTED default"
