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
