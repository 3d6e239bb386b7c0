"""docs/deploy.md's consortium in containers: the image built for real, one container per party on a private
network, a short study run to its end.

The guide is the script. Section 2's bash blocks run as written on the operator's workstation (this host's
Python), making the CA, the certificates, the roster and the enrollment kits. Sections 3 and 4's install
blocks run with the guide's container substitutions (uid 10001 for the service users) into a folder per
host instead of /etc/fedlt, with the guide's `consortium.toml` (2 rounds instead of 100) and `silo.toml`.
The aggregator, three silo agents and the operator's `status` then run as containers of the image, on an
`--internal` network where `aggregator.example.org` is the aggregator's network alias. Each silo's data is a
small image folder made here.

Needs root and a podman that can run containers (docs/deploy.md, "What was checked", says how it was set up
on the machine where this was written); the base is built with deploy/base/build.sh when it is missing, and
torch's wheel fetched with deploy/wheelhouse.sh (TORCH_FIND_LINKS names a folder holding it where PyTorch's
index cannot be reached).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GUIDE = ROOT / "docs" / "deploy.md"
IMAGE = "localhost/fedlt:0.1.0"
WHEELHOUSE = ROOT / "build" / "wheelhouse"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
SILOS = ("st-marys", "city-clinic", "north-bank")
ROUNDS = 2
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def section(number: int) -> str:
    text = GUIDE.read_text()
    start = text.index(f"\n## {number}. ")
    return text[start : text.index("\n## ", start + 1)]


def blocks(text: str, kind: str) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language == kind]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return done


def base_image() -> str:
    (base,) = re.findall(r"^FROM\s+(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    return base


def engine_or_skip() -> None:
    """Skip, saying why, where this machine cannot build and run the image."""
    if shutil.which("podman") is None:
        pytest.skip("no podman here (apt-get install podman): the container walkthrough needs an engine")
    if os.geteuid() != 0:
        pytest.skip("the walkthrough installs files owned by uid 10001 as docs/deploy.md does: run as root")
    if podman("image", "exists", base_image(), check=False).returncode != 0:
        if shutil.which("mmdebstrap") is None:
            pytest.skip(f"no base image {base_image()} and no mmdebstrap to build it (deploy/base/build.sh)")
        build = subprocess.run(
            ["bash", str(DEPLOY / "base" / "build.sh"), str(ROOT / "build" / "base")],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert build.returncode == 0, build.stdout + build.stderr
    probe = podman("run", "--rm", base_image(), "true", check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()}")


def build_image() -> float:
    """deploy/Dockerfile's build as its header gives it; seconds taken."""
    if not list(WHEELHOUSE.glob("torch-*.whl")):
        fetch = subprocess.run(
            ["bash", str(DEPLOY / "wheelhouse.sh"), str(WHEELHOUSE)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if fetch.returncode != 0 and not os.environ.get("TORCH_FIND_LINKS"):
            pytest.skip(  # PyTorch's index unreachable from here: a limit of the machine, not of the image
                "torch's CPU wheel could not be fetched from PyTorch's index; set TORCH_FIND_LINKS to a "
                "folder holding it (deploy/wheelhouse.sh)"
            )
        assert fetch.returncode == 0, fetch.stdout + fetch.stderr
    # The builder trusts what this host trusts: behind a TLS-inspecting proxy, pip in the build needs its CA.
    trust = ["--volume", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"] if CA_BUNDLE.exists() else []
    started = time.monotonic()
    build = ["-f", str(DEPLOY / "Dockerfile"), "--build-context", f"wheels={WHEELHOUSE}", *trust]
    podman("build", *build, "-t", IMAGE, str(ROOT), timeout=3600)
    return time.monotonic() - started


def make_kits(folder: Path) -> None:
    """Section 2 as written: the CA, every certificate, the roster and the kits."""
    script = "\n".join(
        ["set -euo pipefail", f'python() {{ "{sys.executable}" "$@"; }}', *blocks(section(2), "bash")]
    )
    done = subprocess.run(["bash", "-c", script], cwd=folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def as_container_host(command: str, host: Path) -> str:
    """An install block of sections 3-4 for a container host whose /etc/fedlt is `host`/etc/fedlt."""
    command = command.replace("sudo ", "").replace(" /etc/fedlt", f" {host}/etc/fedlt")
    return command.replace("fedlt-aggregator", "10001").replace("fedlt-silo", "10001")


def install(host: Path, kit: Path, config: str, block: str) -> Path:
    """Unpack a kit and install it and the config with the guide's owners and modes; the host's /etc/fedlt."""
    host.mkdir()
    shutil.copy(kit, host)
    name = "consortium.toml" if "[consortium]" in config else "silo.toml"
    (host / name).write_text(config)
    script = "set -euo pipefail\n" + as_container_host(block, host)
    done = subprocess.run(["bash", "-c", script], cwd=host, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return host / "etc" / "fedlt"


def consortium_toml() -> str:
    (config,) = [b for b in blocks(section(3), "toml") if "[consortium]" in b]
    assert "rounds = 100" in config
    return config.replace("rounds = 100", f"rounds = {ROUNDS}")


def silo_toml(silo: str) -> str:
    (config,) = blocks(section(4), "toml")
    return config.replace("st-marys", silo)


def image_folder(folder: Path, seed: int, per_class: int = 12) -> None:
    """Ten classes "0".."9" of 28x28 grey images: class c is a bright square at its own place, on noise."""
    rng = np.random.default_rng(seed)
    for label in range(10):
        (folder / str(label)).mkdir(parents=True)
        row, column = divmod(label, 5)
        for index in range(per_class):
            pixels = rng.integers(0, 60, (28, 28))
            pixels[4 + 10 * row : 12 + 10 * row, 1 + 5 * column : 6 + 5 * column] += 180
            Image.fromarray(pixels.astype(np.uint8), "L").save(folder / str(label) / f"{index}.png")
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


class Party:
    """Containers, volumes and the network of one test, all removed at the end, pass or fail. Every
    container runs as the guide runs them (`--init`), on the private network, and with a read-only root file
    system (podman gives it a fresh /tmp), as the Kubernetes manifests run them."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(4)
        self.network = f"fedlt-walkthrough-{self.tag}"
        self.containers: list[str] = []
        self.volumes: list[str] = []

    def volume(self, role: str) -> str:
        name = f"fedlt-{role}-data-{self.tag}"
        self.volumes.append(name)
        return name

    def options(self, *args: str) -> list[str]:
        return ["--init", "--read-only", "--network", self.network, *args]

    def start(self, name: str, *args: str) -> str:
        container = f"{name}-{self.tag}"
        self.containers.append(container)
        podman("run", "--detach", "--name", container, *self.options(*args))
        return container

    def once(self, *args: str) -> subprocess.CompletedProcess:
        return podman("run", "--rm", *self.options(*args), timeout=300)

    def remove(self) -> None:
        for container in self.containers:
            podman("rm", "--force", "--time", "5", container, check=False)
        for volume in self.volumes:
            podman("volume", "rm", "--force", volume, check=False)
        podman("network", "rm", "--force", self.network, check=False)


@pytest.fixture
def party() -> Iterator[Party]:
    engine_or_skip()
    party = Party()
    try:
        yield party
    finally:
        party.remove()


def logs(container: str) -> str:
    done = podman("logs", container, check=False)
    return done.stdout + done.stderr


def wait_for_log(container: str, text: str, timeout: float) -> None:
    until = time.monotonic() + timeout
    while text not in logs(container):
        state = podman("inspect", "--format", "{{.State.Status}}", container).stdout.strip()
        assert state == "running", f"{container} is {state} before logging {text!r}:\n{logs(container)}"
        assert time.monotonic() < until, f"{container} has not logged {text!r} after {timeout} s"
        time.sleep(1)


def exit_code(container: str, timeout: float) -> int:
    return int(podman("wait", container, timeout=timeout).stdout.strip())


def hosts(folder: Path) -> dict[str, Path]:
    """Sections 2 to 4: the workstation's CA and kits, then each host's /etc/fedlt and each silo's data."""
    workstation = folder / "workstation"
    workstation.mkdir()
    make_kits(workstation)
    kits = workstation / "kits"
    (install_aggregator,) = [b for b in blocks(section(3), "bash") if "tar -xzf" in b]
    etc = {
        "aggregator": install(
            folder / "aggregator", kits / "aggregator-kit.tar.gz", consortium_toml(), install_aggregator
        )
    }
    (install_silo,) = [b for b in blocks(section(4), "bash") if "tar -xzf" in b]
    for number, silo in enumerate(SILOS):
        block = install_silo.replace("st-marys", silo)
        etc[silo] = install(folder / silo, kits / f"{silo}-kit.tar.gz", silo_toml(silo), block)
        image_folder(folder / silo / "srv" / "fedlt" / "data" / "train", seed=number)
    return etc


def test_the_guides_consortium_runs_in_containers_on_a_private_network(tmp_path, party):
    seconds = {"build": build_image()}
    etc = hosts(tmp_path)
    key = etc["st-marys"] / "pki" / "st-marys.key"
    assert (key.stat().st_uid, key.stat().st_mode & 0o777) == (10001, 0o600)

    podman("network", "create", "--internal", party.network)
    started = time.monotonic()
    aggregator = party.start(
        "fedlt-aggregator",
        *("--network-alias", "aggregator.example.org"),
        *("-v", f"{etc['aggregator']}:/etc/fedlt:ro", "-v", f"{party.volume('aggregator')}:/var/lib/fedlt"),
        IMAGE,
    )
    wait_for_log(aggregator, "listening on 0.0.0.0:50051 (mutual TLS)", timeout=300)
    seconds["aggregator up"] = time.monotonic() - started

    silos = []
    for silo in SILOS:
        data = tmp_path / silo / "srv" / "fedlt" / "data"
        mounts = ["-v", f"{etc[silo]}:/etc/fedlt:ro", "-v", f"{party.volume(silo)}:/var/lib/fedlt"]
        mounts += ["-v", f"{data}:/srv/fedlt/data:ro"]
        shown = party.once(*mounts, IMAGE, "silo", "roster", "show", "--config", "/etc/fedlt/silo.toml")
        assert "example-health" in shown.stdout, shown.stdout
        silos.append(
            party.start(f"fedlt-{silo}", *mounts, IMAGE, "silo", "run", "--config", "/etc/fedlt/silo.toml")
        )
    for container in silos:
        assert exit_code(container, timeout=1200) == 0, logs(container)
        assert f"consortium finished after {ROUNDS} rounds" in logs(container), logs(container)
    seconds["study"] = time.monotonic() - started

    # Section 5 on the workstation, a container on the network; its consortium.toml names its copy of ca.pem.
    workstation = tmp_path / "workstation"
    (workstation / "consortium.toml").write_text(consortium_toml().replace('"pki/ca.pem"', '"ca/ca.pem"'))
    (status_command,) = blocks(section(5), "bash")[:1]
    argv = status_command.replace("\\\n", " ").split()[3:]  # after `python -m aggregator`
    status = party.once(
        "--user", "0:0", "-v", f"{workstation}:/ws:ro", "-w", "/ws", IMAGE, "aggregator", *argv
    )
    assert f"rounds committed: {ROUNDS}/{ROUNDS}   stage: finished" in status.stdout, status.stdout

    stopping = time.monotonic()
    podman("stop", "--time", "30", aggregator, timeout=60)
    assert exit_code(aggregator, timeout=60) == 0, logs(aggregator)
    seconds["stop"] = time.monotonic() - stopping
    volume = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", party.volumes[0]).stdout.strip())
    assert (volume.stat().st_uid, volume.stat().st_mode & 0o777) == (10001, 0o700)
    print(f"\n--- timings (s): {', '.join(f'{k} {v:.1f}' for k, v in seconds.items())}")
    print(f"--- aggregator log:\n{logs(aggregator)}\n--- {SILOS[0]} log:\n{logs(silos[0])}")
    print(f"--- status:\n{status.stdout}")
