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


def section(title: str) -> str:
    """The text under `## title` up to the next `## ` heading, its whitespace collapsed and lower-cased."""
    text = (ROOT / "docs" / "threat-model.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/threat-model.md has no section '## {title}'"
    return " ".join(match.group(1).split()).lower()


def test_the_ckks_section_says_who_can_decrypt_what():
    ckks = section("CKKS (`ckks`)")
    for statement in (
        "no threshold decryption",
        "the aggregator holds the public context only",
        "one silo colluding with the aggregator",
        "every other silo's individual upload",
        "until the key is rotated",
        "the key holder seals different keys to different silos",
        "report the totals",
        "zero-sum pairwise masks",
        "218 bits",
        "approximate",
        "does not prove the sum",
        "when to pick which",
    ):
        assert statement in ckks, statement


def test_the_dp_section_says_what_the_guarantee_covers_and_what_it_does_not():
    dp = section("Differential privacy")
    for statement in (
        "add/remove one record",
        "the ledger refuses work past the budget",
        "never from the run seed",
        "c colluders who withhold their noise",
        "group privacy",
        "the census is empty",
        "only if its `[dp] report = true`",
    ):
        assert statement in dp, statement
