"""Where a party computes (`fedlt.device`): `[train] device` in the simulator, `[compute] device` at a silo.

Every form resolved and every GPU that is not there refused in one line; the device left out of a plan's
text and hash and out of a run's fingerprint; the CPU path unchanged to the bit. Meta tensors stand in for
a GPU on machines without one: they hold no numbers, but like CUDA's they refuse to meet a CPU tensor in
most ops, so a batch, a prior or the per-record norms of DP-SGD left behind on the CPU fail here (an
in-place add of a CPU tensor, as DP-SGD's noise is added, slips through on meta). The tests marked `cuda`
compare the GPU's numbers with the CPU's where a GPU is lent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedlt.config import as_toml
from fedlt.data.embedded import load_embedded
from fedlt.device import DEVICE_FORM, DeviceError, device_problem, resolve_device
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.methods import METHODS, ModelSpec, SiloContext, TrainConfig
from fedlt.methods.balanced import CLASS_COUNTS
from fedlt.metrics import predict
from fedlt.plan import RoundPlan
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import run_simulation
from privacy.dp import Budget, PrivacyLedger, SiloPrivacy
from privacy.dp.noise import SecureRandom
from silo.config import load_silo_config

ROOT = Path(__file__).resolve().parent.parent
FAST = {"dataset": "digits", "silos": 3, "rounds": 2, "imbalance": 10.0, "alpha": 0.5}
DP = DPSettings(enabled=True, epsilon=1e6, noise_multiplier=1.0)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run where one is lent)")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `count` GPUs, built for CUDA `build` (None: the CPU build)."""

    def pretend(count: int, *, build: str | None = "12.8") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.version, "cuda", build)

    return pretend


# --- resolution: every form, and the hardware that is not there ---------------------------------------


@pytest.mark.parametrize(
    ("name", "count", "expected"),
    [
        ("cpu", 0, "cpu"),
        ("cpu", 2, "cpu"),
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda:0"),
        ("cuda", 1, "cuda:0"),
        ("cuda:0", 1, "cuda:0"),
        ("cuda:1", 2, "cuda:1"),
        ("cuda:12", 13, "cuda:12"),
    ],
)
def test_every_form_resolves_to_the_device_it_names(gpus, name, count, expected):
    gpus(count)
    assert resolve_device(name) == torch.device(expected)


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_a_gpu_asked_of_the_cpu_build_is_refused_saying_how_to_get_one(gpus, name):
    gpus(0, build=None)
    with pytest.raises(DeviceError) as refused:
        resolve_device(name, setting="compute.device")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"compute.device = {name!r}, but this torch")
    assert "is the CPU build" in message
    assert "install the CUDA build of torch" in message
    assert "bring-your-own.md" in message


def test_a_cuda_build_that_finds_no_gpu_points_at_the_driver(gpus):
    gpus(0, build="12.8")
    with pytest.raises(DeviceError, match=r"\(CUDA 12\.8\) finds no GPU: check the NVIDIA driver"):
        resolve_device("cuda", setting="train.device")


@pytest.mark.parametrize(
    ("count", "name", "there"),
    [(2, "cuda:2", "sees 2 GPUs here (cuda:0 to cuda:1"), (1, "cuda:1", "sees 1 GPU here (cuda:0 only")],
)
def test_a_gpu_past_the_last_is_refused_naming_those_there(gpus, count, name, there):
    gpus(count)
    with pytest.raises(DeviceError) as refused:
        resolve_device(name, setting="train.device")
    assert str(refused.value).startswith(f"train.device = {name!r}, but torch {there}")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "name", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1.0", "cuda0", " cpu", "cpu ", "mps", "", 3, None]
)
def test_names_of_no_form_are_refused_by_form(gpus, name):
    gpus(2)
    assert device_problem(name) == f"expected {DEVICE_FORM}, got {name!r}"
    with pytest.raises(DeviceError, match="expected"):
        resolve_device(name)


@given(st.one_of(st.text(max_size=10), st.from_regex(r"cuda:[0-9]{1,3}", fullmatch=True)))
def test_any_text_is_a_device_or_refused_by_its_form(name):
    index = name.removeprefix("cuda:")
    named = name in ("auto", "cpu", "cuda") or (
        name.startswith("cuda:") and index.isascii() and index.isdigit()
    )
    assert (device_problem(name) is None) == named


@given(st.integers(0, 99), st.integers(0, 16))
def test_a_gpu_resolves_exactly_when_torch_sees_that_many(index, count):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: count > 0)
        patch.setattr(torch.cuda, "device_count", lambda: count)
        if index < count:
            assert resolve_device(f"cuda:{index}") == torch.device("cuda", index)
        else:
            with pytest.raises(DeviceError, match="GPU"):
                resolve_device(f"cuda:{index}")


# --- configuration: checked at load for its form, never part of a plan ---------------------------------


def test_the_simulator_refuses_a_device_of_no_form_with_every_other_problem(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text('[train]\ndevice = "gpu"\nlr = -1.0\n')
    with pytest.raises(ConfigError) as refused:
        load_sim_config(str(path), {})
    problems = refused.value.problems
    assert f"train.device: expected {DEVICE_FORM}, got 'gpu'" in problems
    assert any(p.startswith("train.lr:") for p in problems)


def test_reading_a_config_asks_nothing_of_the_machine(gpus):
    gpus(0, build=None)
    config = load_sim_config(None, FAST, tables={"train": {"device": "cuda:3"}})
    assert config.train.device == "cuda:3"  # refused where it is used, not where it is read


def test_the_device_is_no_part_of_a_plan():
    plan = RoundPlan(train=TrainConfig(device="cuda:1"))
    assert "device" not in plan.to_toml()
    assert "device" not in as_toml(plan)
    assert plan.sha256() == RoundPlan().sha256()
    assert RoundPlan.from_toml(plan.to_toml(), "plan").train == TrainConfig()


def test_a_run_keeps_its_fingerprint_on_any_device():
    """So a run started on one machine resumes on another."""
    default = load_sim_config(None, FAST)
    for device in ("cpu", "cuda", "cuda:1"):
        elsewhere = load_sim_config(None, FAST, tables={"train": {"device": device}})
        assert elsewhere.fingerprint() == default.fingerprint()


def test_a_silo_chooses_its_device_in_compute(tmp_path, gpus):
    gpus(0, build=None)
    path = tmp_path / "silo.toml"
    embedded = '[data]\nsource = "embedded"\n'
    path.write_text(embedded)
    assert load_silo_config(path).compute.device == "auto"
    path.write_text(embedded + '\n[compute]\ndevice = "cuda:1"\n')
    assert load_silo_config(path).compute.device == "cuda:1"  # its form; the agent asks the machine
    path.write_text(embedded + '\n[compute]\ndevice = "gpu"\nthreads = -1\n')
    with pytest.raises(ConfigError) as refused:
        load_silo_config(path)
    assert f"compute.device: expected {DEVICE_FORM}, got 'gpu'" in refused.value.problems
    assert any(p.startswith("compute.threads:") for p in refused.value.problems)


def test_a_silo_asked_for_a_gpu_it_lacks_stops_in_one_line_before_writing_anything(tmp_path, gpus):
    from silo.agent import SiloAgent
    from tests.consortium_harness import write_kit

    gpus(0, build=None)
    (config,) = write_kit(tmp_path, silos=1)
    config.write_text(config.read_text().replace("[compute]\n", '[compute]\ndevice = "cuda"\n'))
    silo = load_silo_config(config)
    with pytest.raises(DeviceError, match=r"^compute.device = 'cuda', but this torch") as refused:
        SiloAgent(silo)
    assert "\n" not in str(refused.value)
    assert not silo.path(silo.state_dir).exists()


def test_a_plan_naming_a_device_is_overruled_by_the_silos_own(gpus):
    from silo.admission import PlanCache

    gpus(0, build=None)
    plan = replace(RoundPlan(), train=replace(RoundPlan().train, device="cuda:7"))
    cache = PlanCache(PrivacyLedger(Budget(1.0, 1e-5)), device="cpu")
    assert cache.method(plan, "sha").train.device == "cpu"


# --- the CPU path is the one it was ---------------------------------------------------------------------


def _quiet(_line: str) -> None:
    pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the GPU here; the cuda tests compare")
def test_a_run_on_the_cpu_is_the_default_run_to_the_bit(tmp_path):
    default = run_simulation(load_sim_config(None, FAST), tmp_path / "auto", echo=_quiet)
    cpu = load_sim_config(None, FAST, tables={"train": {"device": "cpu"}})
    pinned = run_simulation(cpu, tmp_path / "cpu", echo=_quiet)
    strip = lambda m: [{k: v for k, v in r.items() if "seconds" not in k} for r in m["rounds"]]  # noqa: E731
    assert pinned.state.digest() == default.state.digest()
    assert strip(pinned.metrics) == strip(default.metrics)


# --- local training keeps every tensor on the model's device (meta stands in for a GPU) ------------------

# each trains with its own loss or hooks: FedProx's anchors, RedGrape's two heads and balanced set, SFD's
# ABBL with its prior, the balanced recipe's prior and shifted batches
TRAINERS = ("fedavg", "fedprox", "redgrape", "sfd", "balanced")


def _method(name: str, options: dict, *, device: str, private: bool):
    if private and name == "sfd":
        options = {**options, "scl_weight": 0.0}  # under DP SFD trains without its contrastive term
    return METHODS[name](
        options=METHODS[name].Options(**options),
        train=TrainConfig(device=device),
        model=ModelSpec("cnn-small", (1, 8, 8), 10),
        rounds=2,
        dp=DP if private else None,
    )


def _private(method) -> SiloPrivacy:
    """DP for `method` with seeded batches and noise, the same on every device (a test's, never a silo's)."""
    ledger = PrivacyLedger(Budget(DP.epsilon, DP.delta))
    return SiloPrivacy(DP, method=method, ledger=ledger, rng=SecureRandom.seeded("device-test"))


def _digits(n: int = 300):
    data = load_embedded("digits")
    return data.subset(np.arange(n))


def _state(method):
    state = method.init_state(seed=0)
    if method.name == "balanced":  # past its priors round
        state = replace(state, extra={**state.extra, CLASS_COUNTS: torch.full((10,), 30.0)})
    return state


@pytest.mark.parametrize("private", [False, True], ids=["sgd", "dp-sgd"])
@pytest.mark.parametrize("name", TRAINERS)
def test_local_training_keeps_every_tensor_on_the_models_device(name, private):
    method = _method(name, {}, device="cpu", private=private)
    state = _state(method)
    data = _digits()
    model = method.load(state.model).to("meta")
    ctx = SiloContext(1, "silo-0", 0, _private(method) if private else None)
    method.train_model(model, torch.from_numpy(data.x), torch.from_numpy(data.y), state, ctx)
    assert {p.device.type for p in model.parameters()} == {"meta"}


# --- on a GPU: the GPU's numbers against the CPU's -----------------------------------------------------


@cuda
def test_auto_is_the_first_gpu_where_there_is_one():
    assert resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="GPU"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@cuda
def test_a_simulator_run_on_the_gpu_tracks_the_cpu_and_keeps_its_state_on_the_cpu(tmp_path):
    runs = {
        device: run_simulation(
            load_sim_config(None, FAST, tables={"train": {"device": device}}), tmp_path / device, echo=_quiet
        )
        for device in ("cuda", "cpu")
    }
    state = runs["cuda"].state
    assert {t.device.type for t in [*state.model.values(), *state.extra.values()]} == {"cpu"}
    for gpu, cpu in zip(runs["cuda"].metrics["rounds"], runs["cpu"].metrics["rounds"], strict=True):
        assert abs(gpu["accuracy"] - cpu["accuracy"]) <= 0.05


# each silo half that computes on the device: training, the head gradients of CReFF and RedGrape (with
# its re-balancing step on), the statistics of CCVR (every round), SFD's and DFL-FS's closing rounds
ROUNDS = [
    ("fedavg", {}, False),
    ("fedprox", {}, False),
    ("creff", {}, False),
    ("redgrape", {}, False),
    ("ccvr", {"calibrate": "every-round"}, False),
    ("sfd", {}, False),
    ("sfd", {}, True),
    ("dflfs", {}, True),
    ("balanced", {}, False),
]


def local_round(name: str, options: dict, closing: bool, *, device: str, private: bool) -> dict:
    """One local round from the initial state on `device`: the contribution's values, checked to be on the
    CPU, and the working model's device after it."""
    method = _method(name, options, device=device, private=private)
    state = _state(method)
    if name == "redgrape":  # known prototypes switch the re-balancing step on
        prototypes = torch.randn(10, 10, method.feature_dim + 1, generator=torch.Generator().manual_seed(0))
        state = replace(state, extra={"prototypes": prototypes, "known": torch.ones(10)})
    if closing:
        state = replace(state, extra={**state.extra, "trained": torch.tensor(method.rounds)})
    ctx = SiloContext(1, "silo-0", 0, _private(method) if private else None)
    contribution = method.local_round(state, _digits(), ctx)
    assert {v.device.type for v in contribution.values.values()} == {"cpu"}
    assert next(method.working_model().parameters()).device.type == "cpu"
    return dict(contribution.values)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@cuda
@pytest.mark.parametrize("private", [False, True], ids=["sgd", "dp-sgd"])
@pytest.mark.parametrize(("name", "options", "closing"), ROUNDS)
def test_a_local_round_on_the_gpu_gives_the_cpus_contribution(name, options, closing, private):
    """Same batches, same noise (a seeded stream); the numbers differ by the GPU's kernels only (cuDNN's
    convolutions in TF32 by default), a few in a hundred after a round of training at most."""
    gpu = local_round(name, options, closing, device="cuda", private=private)
    cpu = local_round(name, options, closing, device="cpu", private=private)
    assert gpu.keys() == cpu.keys()
    for field, value in cpu.items():
        assert relative_difference(gpu[field], value) <= 0.05, field


@cuda
def test_predictions_on_the_gpu_are_the_cpus():
    data = load_embedded("digits")
    method = _method("fedavg", {}, device="cuda", private=False)
    model = method.load(method.init_state(seed=0).model)
    on_gpu = predict(model, data.x, device=torch.device("cuda"))
    assert next(model.parameters()).device.type == "cpu"
    assert np.mean(on_gpu == predict(model, data.x)) >= 0.99


# --- benchmarks/device_check.sh ------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it runs the whole check (minutes)")
def test_device_check_says_in_one_line_that_there_is_no_gpu_and_exits_0():
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_check.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("device_check: no GPU here"), done.stdout
    assert done.stdout.count("\n") == 1, done.stdout
