"""The simulator on Ray (`[sim] backend = "ray"`): the same bits as the serial backend, a dead task run
again, a run that moves between backends, and clear errors where Ray is missing or unreachable. Clusters of
their own (several nodes, a node removed mid-round) are in tests/test_sim_ray_cluster.py."""

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from fedlt.errors import ConfigError
from fedlt.methods import GlobalState
from fedlt.sim.__main__ import main
from fedlt.sim.backend import BackendConfig, BackendUnavailable, RayBackend, _tensor_in, _tensor_out
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import CHECKPOINT, run_simulation

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
FAST = {"dataset": "digits", "silos": 4, "rounds": 2, "imbalance": 10.0, "alpha": 0.5, "threads": 1}
MFSC = {"per_round": 2, "selection": "mfsc"}  # a disclosure from every silo, then training by 2 of them


def _config(**overrides):
    return load_sim_config(None, {**FAST, **overrides})


def _quiet(_line):
    pass


def _without_timing(metrics: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in metrics["rounds"]]


def test_without_ray_the_cli_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    flags = ["--dataset", "digits", "--silos", "3", "--rounds", "1", "--quiet", "--backend", "ray"]
    assert main([*flags, "--out", str(tmp_path)]) == 2
    assert "pip install 'fedlt[ray]'" in capsys.readouterr().err


def test_an_unreachable_head_node_is_a_clear_error(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = _config(backend="ray", address=f"127.0.0.1:{port}")
    with pytest.raises(BackendUnavailable, match=f"no Ray head node answers at 127.0.0.1:{port}"):
        run_simulation(config, tmp_path, echo=_quiet)


def test_the_backend_is_not_part_of_a_runs_identity():
    assert _config(backend="ray", workers=3).fingerprint() == _config(threads=0).fingerprint()
    assert _config(seed=1).fingerprint() != _config().fingerprint()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(6.0, dtype=torch.float64).reshape(2, 3).t(),  # a view, not contiguous
        torch.tensor([1 + 2j]).conj(),  # a lazy conjugate
        -torch.tensor([1.0, 2.0]),
        torch.tensor([1.5], dtype=torch.bfloat16),  # no NumPy dtype: torch's own pickling
        torch.ones(3, requires_grad=True) * 2,
    ],
)
def test_a_tensor_crosses_to_and_from_a_ray_worker_unchanged(tensor):
    """Tensors travel as NumPy arrays (`_tensor_out`, `_tensor_in`): same dtype and bits, a writable copy."""
    back = _tensor_in(_tensor_out(tensor))
    assert back.dtype == tensor.dtype
    assert torch.equal(back, tensor.detach().resolve_conj().resolve_neg())
    back.add_(1)  # writable, unlike the read-only array Ray hands over


def test_ray_with_a_gpu_named_for_training_is_refused_at_load():
    with pytest.raises(ConfigError, match="Ray's tasks train on their nodes' CPUs"):
        _config(backend="ray", device="cuda")


@pytest.fixture(scope="module")
def local_ray():
    """One local cluster for the tests below, started once: a start costs seconds, and on a busy machine a
    start right after another cluster's shutdown has outlasted Ray's 30 s wait for its raylet. It stays up
    until the module ends, so the tests above, which need none running, come first. (A run that starts its
    own cluster is in the slow tests.)"""
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # Ray raises a bare Exception when its raylet starts late
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()  # once more: the first start of a fresh venv also compiles Ray's modules
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_gives_the_serial_backends_bits(tmp_path, local_ray):
    """MFSC: every silo's disclosure, then 2 silos' training, each a Ray task."""
    serial = run_simulation(_config(**MFSC), tmp_path / "serial", echo=_quiet)
    on_ray = run_simulation(_config(backend="ray", **MFSC), tmp_path / "ray", echo=_quiet)
    assert on_ray.state.digest() == serial.state.digest()
    assert _without_timing(on_ray.metrics) == _without_timing(serial.metrics)


def test_a_run_begun_on_ray_resumes_serial_to_the_same_bits(tmp_path, local_ray):
    whole = run_simulation(_config(), tmp_path / "whole", echo=_quiet)
    run_simulation(_config(rounds=1, backend="ray"), tmp_path / "moved", echo=_quiet)
    lines = []
    resumed = run_simulation(_config(), tmp_path / "moved", echo=lines.append)
    assert lines[0].startswith("resuming")
    assert resumed.state.digest() == whole.state.digest()
    assert _without_timing(resumed.metrics) == _without_timing(whole.metrics)


@pytest.mark.slow  # its parts are in the default run: a stream and a ledger that pickle (test_dp_*)
def test_under_dp_each_silo_spends_on_ray_what_it_spends_serial(tmp_path, local_ray):
    """A silo's DP side (its ledger, its CSPRNG) travels with its task and comes back spent: the ledgers
    after two rounds are the serial backend's (the noise itself is fresh from the OS on either)."""
    dp = {"epsilon": 8.0, "rounds": 2}
    serial = run_simulation(_config(**dp), tmp_path / "serial", echo=_quiet)
    on_ray = run_simulation(_config(backend="ray", **dp), tmp_path / "ray", echo=_quiet)
    spent = [[r["epsilon_spent"] for r in run.metrics["rounds"]] for run in (serial, on_ray)]
    assert spent[0] == spent[1]
    assert spent[0][0] < spent[0][1] <= 8.0
    ledgers = [_ledgers(tmp_path / name) for name in ("serial", "ray")]
    assert ledgers[0] == ledgers[1]
    assert len(ledgers[0]) == FAST["silos"]


def _ledgers(run: Path) -> dict:
    """Each silo's ledger entries, from the run's checkpoint, without the noisy values they record."""
    saved = json.loads(torch.load(run / CHECKPOINT, weights_only=True)["ledgers"])
    return {
        silo: [(e["mechanism"], e["what"], e["epsilon_after"]) for e in entries]
        for silo, entries in saved.items()
    }


def _exit_on_first_attempt(marker):
    """A job whose worker process dies the first time it runs (as on an OOM kill), then works."""

    def job(method, state, silo, arg):
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return arg * 2, len(silo)

    return job


def test_a_task_whose_worker_dies_is_run_again(tmp_path, local_ray):
    silos = {"silo-0": _one_silo()}
    backend = RayBackend(silos, BackendConfig(backend="ray", threads=1))
    job = _exit_on_first_attempt(str(tmp_path / "died-once"))
    results = backend.submit(job, None, GlobalState(0, {}, {}), [("silo-0", 21)])()
    assert (tmp_path / "died-once").exists()  # the first attempt did die
    assert results == [(42, len(silos["silo-0"]))]


def _one_silo():
    from fedlt.data.federation import build_federation

    return build_federation(_config().data, seed=0).silos[0]
