"""docs/threat-model.md names, for every row, the test that mounts the attack: each named test must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`")


def cited_tests() -> list[tuple[str, str]]:
    """(file, test) pairs; a bare `::name` continues the file last named in the same row."""
    cited = []
    for line in (ROOT / "docs" / "threat-model.md").read_text().splitlines():
        current = None
        for path, name, bare in CELL.findall(line):
            current = path or current
            if name or bare:
                cited.append((current, name or bare))
    return cited


def test_every_test_the_threat_model_cites_exists():
    cited = cited_tests()
    assert len(cited) >= 30
    missing = []
    for path, name in cited:
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if name not in names:
            missing.append(f"{path}::{name}")
    assert not missing, missing
