"""The deployment files keep their promises: each role runs as its own user with its own state directory
under a hardened unit (co-located, the aggregator cannot read a silo's key, secrets or ledgers), the image's
base is pinned by digest and rebuilt to the same digest, every dependency the image installs is checked
against a hash, and the compose file and Kubernetes manifests hold what the guide says and pass the API's
schemas. tests/test_containers.py builds the image and runs the consortium in containers."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from deploy.base.oci import REF as BASE_NAME
from deploy.base.oci import build as build_base_archive

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
    """Every shell command of the image's RUN lines, continuation lines joined, RUN's own flags dropped."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    commands = []
    for line in joined.splitlines():
        if line.startswith("RUN "):
            command = re.sub(r"^RUN\s+(--\S+\s+)*", "", line)
            commands += [c.strip() for c in command.split("&&")]
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
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "dicom"
    ]:
        assert Requirement(line).name.lower() in lock, f"the image's silos read DICOM: {line} is not locked"


def test_the_build_context_holds_the_lock_and_no_more():
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert dockerignore[dockerignore.index("*") :].count("!deploy/requirements.txt") == 1
    assert "!deploy/" not in dockerignore
    assert "COPY deploy/requirements.txt " in (DEPLOY / "Dockerfile").read_text()


def test_the_image_is_built_on_the_base_that_deploy_base_builds():
    """No registry image can be pulled where the image was built: its base is Debian 12's own packages,
    built by deploy/base/build.sh under the name the Dockerfile pins, from the versions listed beside it."""
    (base,) = re.findall(r"^FROM\s+(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    name, _, _ = base.partition("@")
    assert name == f"localhost/{BASE_NAME}", "deploy/base/oci.py names the archive it writes"
    build = (DEPLOY / "base" / "build.sh").read_text()
    assert f"{name}@$digest" in build
    assert "SOURCE_DATE_EPOCH=" in build
    packages = dict(
        line.split("=", 1) for line in (DEPLOY / "base" / "packages.txt").read_text().splitlines()
    )
    assert packages["python3.11"].startswith("3.11."), "the lock is compiled for CPython 3.11"
    assert "python3.11-venv" in packages


def _rootfs(mtime: int) -> bytes:
    """A two-file root file system tarball, as mmdebstrap writes one (sorted, clamped mtimes)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in (("./etc/os-release", b"ID=debian\n"), ("./usr/bin/true", b"\x7fELF")):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _blobs(archive_path: Path) -> dict[str, bytes]:
    with tarfile.open(archive_path) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def test_the_base_archive_has_the_same_digest_whenever_and_wherever_it_is_made(tmp_path):
    """`podman import` stamps the current time into the image's config, so each build of the same files got
    another digest and the pin could never be checked; the base's archive depends on its files alone."""
    digests = []
    for attempt in ("first", "second"):
        folder = tmp_path / attempt
        folder.mkdir()
        (folder / "rootfs.tar").write_bytes(_rootfs(mtime=1735689600))
        digests.append(build_base_archive(folder / "rootfs.tar", folder / "base.oci.tar", 1735689600))
    assert digests[0] == digests[1]
    blobs = _blobs(tmp_path / "first" / "base.oci.tar")
    (manifest_entry,) = json.loads(blobs["index.json"])["manifests"]
    manifest = blobs[f"blobs/sha256/{digests[0].removeprefix('sha256:')}"]
    assert manifest_entry["digest"] == digests[0] == "sha256:" + hashlib.sha256(manifest).hexdigest()
    for layer in json.loads(manifest)["layers"]:  # every blob is stored under its own digest
        assert hashlib.sha256(blobs[f"blobs/sha256/{layer['digest'][7:]}"]).hexdigest() == layer["digest"][7:]
    other = tmp_path / "other"
    other.mkdir()
    (other / "rootfs.tar").write_bytes(_rootfs(mtime=1735689601))
    assert build_base_archive(other / "rootfs.tar", other / "base.oci.tar", 1735689600) != digests[0]


def test_torch_reaches_the_image_from_a_mounted_wheelhouse_and_is_hash_checked():
    """The PyTorch index cannot be reached from every builder: torch's wheel comes from a separate build
    context, mounted for the one install step (not copied into a layer), under the lock's hashes."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", dockerfile)
    (install,) = [
        line for line in joined.splitlines() if line.startswith("RUN ") and "--require-hashes" in line
    ]
    mount = re.search(r"--mount=type=bind,from=wheels,target=(\S+)", install)
    assert mount, install
    assert f"--find-links {mount.group(1)}" in install
    assert "download.pytorch.org" not in install
    assert "wheels" not in " ".join(re.findall(r"^COPY .*", dockerfile, re.M))
    script = (DEPLOY / "wheelhouse.sh").read_text()
    assert "--require-hashes" in script
    assert "--build-context wheels=build/wheelhouse" in dockerfile


def _manifests() -> list[tuple[str, dict]]:
    return [
        (path.name, document)
        for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
    ]


def test_the_kubernetes_manifests_pass_the_apis_schemas():
    kinds = {(name, document["kind"]) for name, document in _manifests()}
    assert {
        ("aggregator.yaml", "StatefulSet"),
        ("aggregator.yaml", "Service"),
        ("silo.yaml", "StatefulSet"),
    } <= kinds
    for name, document in _manifests():
        assert kubernetes_validate.validate(document, "1.37.0", strict=True), name


def test_the_schema_check_refuses_a_misspelt_field():
    """The validator is not a formality: a field Kubernetes would ignore silently is refused."""
    (statefulset,) = [d for n, d in _manifests() if n == "aggregator.yaml" and d["kind"] == "StatefulSet"]
    statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(statefulset, "1.37.0", strict=True)


def _guide_configs() -> tuple[dict, dict]:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    blocks = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", guide, re.S)]
    (consortium,) = [b for b in blocks if "consortium" in b]
    (silo,) = [b for b in blocks if "state_dir" in b]
    return consortium, silo


def test_the_pods_run_the_guides_configs_with_the_key_copied_out_of_the_secret():
    """Kubernetes gives a Secret's files to root and, with fsGroup, adds the group's read bit, which fedlt
    refuses for a key: each pod copies its key, as uid 10001 with mode 0600, and names that copy."""
    consortium, silo = _guide_configs()
    configs = {d["metadata"]["name"]: d["data"] for n, d in _manifests() if d["kind"] == "ConfigMap"}
    pod_consortium = tomllib.loads(configs["fedlt-aggregator-config"]["consortium.toml"])
    pod_silo = tomllib.loads(configs["fedlt-silo-config"]["silo.toml"])
    assert pod_consortium["server"].pop("key") == "/run/fedlt/key/aggregator.key"
    assert pod_silo["connection"].pop("key") == "/run/fedlt/key/st-marys.key"
    consortium["server"].pop("key")
    silo["connection"].pop("key")
    assert (pod_consortium, pod_silo) == (consortium, silo)
    for name, document in _manifests():
        if document["kind"] != "StatefulSet":
            continue
        pod = document["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001, name
        (init,) = pod["initContainers"]
        assert init["command"][:3] == ["install", "-m", "0600"], name
        assert init["command"][-1].startswith("/run/fedlt/key/"), name
        secret_mounts = {v["name"] for v in pod["volumes"] if "secret" in v}
        (container,) = pod["containers"]
        assert not secret_mounts & {m["name"] for m in container["volumeMounts"]}, name


def test_the_compose_file_is_the_guides_consortium_on_a_private_network():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"aggregator", "st-marys", "city-clinic", "north-bank"}
    assert compose["networks"]["consortium"]["internal"] is True
    assert services["aggregator"]["networks"]["consortium"]["aliases"] == ["aggregator.example.org"]
    state = {}
    for name, service in services.items():
        assert service["init"] is True, name
        (volume,) = [v for v in service["volumes"] if v.endswith(":/var/lib/fedlt")]
        state[name] = volume.partition(":")[0]
        assert all(v.endswith(":ro") for v in service["volumes"] if v != volume), name
    assert len(set(state.values())) == len(state), "each party keeps its own state volume"
    assert set(state.values()) <= set(compose["volumes"])
