"""The deployment files keep their promises: each role runs as its own user with its own state directory
under a hardened unit (co-located, the aggregator cannot read a silo's key, secrets or ledgers), the image's
base is pinned by digest, and every dependency the image installs is checked against a hash."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
UNITS = {"aggregator": "fedlt-aggregator.service", "silo": "fedlt-silo.service"}
SHA256 = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def _unit(role: str) -> dict[str, list[str]]:
    """The [Service] settings of a role's unit, each key with every value it is given."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in (DEPLOY / "systemd" / UNITS[role]).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _state_dir(role: str) -> str:
    (state,) = _unit(role)["StateDirectory"]
    return f"/var/lib/{state}"


def test_co_located_roles_run_as_different_users_with_separate_state():
    """Both units once ran as `fedlt` with the one state directory /var/lib/fedlt: an aggregator on a silo's
    host could read that silo's key, its CKKS secret and its ledgers. Each role now has its own."""
    aggregator, silo = _unit("aggregator"), _unit("silo")
    assert aggregator["User"] != silo["User"]
    assert aggregator["Group"] != silo["Group"]
    assert aggregator["CacheDirectory"] != silo["CacheDirectory"]
    ours, theirs = _state_dir("aggregator"), _state_dir("silo")
    assert not (ours + "/").startswith(theirs + "/")
    assert not (theirs + "/").startswith(ours + "/")
    for role, other in (("aggregator", "silo"), ("silo", "aggregator")):
        unit = _unit(role)
        assert unit["ReadWritePaths"] == [_state_dir(role)]
        assert unit["WorkingDirectory"] == [_state_dir(role)]
        assert f"-{_state_dir(other)}" in " ".join(unit["InaccessiblePaths"]).split()
    declared = re.findall(r"^u\s+(\S+)", (DEPLOY / "systemd" / "fedlt.sysusers").read_text(), re.M)
    assert sorted(declared) == sorted([*aggregator["User"], *silo["User"]])


def test_each_unit_is_hardened():
    for role in UNITS:
        unit = _unit(role)
        for key, value in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
            "UMask": "0077",
            "StateDirectoryMode": "0700",
            "CapabilityBoundingSet": "",
        }.items():
            assert unit.get(key) == [value], (role, key)


def test_the_guides_config_files_use_the_units_state_directories():
    """deploy.md's consortium.toml and silo.toml name the very directories the units create and may write."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    blocks = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", guide, re.S)]
    (consortium,) = [b for b in blocks if "consortium" in b]
    (silo,) = [b for b in blocks if "state_dir" in b]
    assert consortium["server"]["data_dir"] == _state_dir("aggregator")
    assert silo["state_dir"] == _state_dir("silo")


def test_the_image_base_is_pinned_by_digest():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    assert bases
    for base in bases:
        assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", base), base


def _runs(dockerfile: str) -> list[str]:
    """Every shell command of the image's RUN lines, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    commands = []
    for line in joined.splitlines():
        if line.startswith("RUN "):
            commands += [c.strip() for c in line.removeprefix("RUN ").split("&&")]
    return commands


def test_every_pip_install_in_the_image_checks_hashes_or_fetches_nothing():
    installs = [c for c in _runs((DEPLOY / "Dockerfile").read_text()) if c.startswith("pip install")]
    assert installs
    for command in installs:
        words = command.split()
        assert "--require-hashes" in words or {"--no-index", "--no-deps"} <= set(words), command


def _lock() -> dict[str, tuple[str, list[str]]]:
    """deploy/requirements.txt: each requirement's pinned version and hashes."""
    pinned = {}
    text = re.sub(r"\\\n", " ", (DEPLOY / "requirements.txt").read_text())
    for line in map(str.strip, text.splitlines()):
        if not line or line.startswith("#"):
            continue
        requirement, *_ = line.split(" #")
        name, _, rest = requirement.partition("==")
        version, *_ = rest.split()
        pinned[name.strip().lower()] = (version, SHA256.findall(requirement))
    return pinned


def test_the_lock_pins_every_dependency_with_hashes_and_torch_on_the_cpu_build():
    lock = _lock()
    assert lock["torch"][0] == "2.13.0+cpu"
    for name, (version, hashes) in lock.items():
        assert version, name
        assert hashes, name
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = requirement.name.lower()
        assert name in lock, f"{name} is not in deploy/requirements.txt: compile it again (docs/deploy.md)"
        assert requirement.specifier.contains(lock[name][0], prereleases=True), (line, lock[name][0])


def test_the_build_context_holds_the_lock_and_no_more():
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert dockerignore[dockerignore.index("*") :].count("!deploy/requirements.txt") == 1
    assert "!deploy/" not in dockerignore
    assert "COPY deploy/requirements.txt " in (DEPLOY / "Dockerfile").read_text()
