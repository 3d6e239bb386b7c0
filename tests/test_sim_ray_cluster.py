"""The simulator and the accuracy grid on Ray clusters of their own, started with Ray's test utilities
(`ray.cluster_utils.Cluster`): two nodes with one removed mid-round, a grid of runs as tasks, and a run beside
a cluster `ray start` left running. A module of its own, so that no cluster of tests/test_sim_ray.py is still
connected when these start (a process joins one cluster at a time)."""

import json
import subprocess
import sys
import threading
import time

import pytest

from fedlt.sim.run import run_simulation
from tests.test_sim_ray import ROOT, _config, _quiet

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def test_a_node_removed_mid_round_loses_no_silo(tmp_path):
    """Two worker nodes of one CPU each (the head takes no tasks); once round 2's tasks keep both busy, one
    node is removed. Ray runs its silo's task again on the other node, and the run ends with the serial
    backend's bits."""
    from ray.cluster_utils import Cluster

    long_tasks = {"rounds": 3, "local_epochs": 40}  # a second or more each: long enough to catch one running
    serial = run_simulation(_config(**long_tasks), tmp_path / "serial", echo=_quiet)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    removed = threading.Event()

    def after_round(r, total, entry):
        if r == 1:
            threading.Thread(target=_remove_when_busy, args=(cluster, nodes[0], removed), daemon=True).start()

    try:
        on_ray = run_simulation(
            _config(**long_tasks, backend="ray"), tmp_path / "ray", echo=_quiet, on_round=after_round
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert removed.is_set()
    assert on_ray.state.digest() == serial.state.digest()


def _remove_when_busy(cluster, node, removed: threading.Event) -> None:
    """Remove `node` as soon as every worker CPU runs a silo's task (within two minutes)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == 0:
            cluster.remove_node(node)
            removed.set()
            return
        time.sleep(0.05)


def test_an_accuracy_grid_runs_as_tasks_on_a_cluster(tmp_path):
    """`benchmarks/accuracy.py --ray ADDRESS`: one task per run on a two-node cluster, every run's result
    back in the driver's table."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    grid = ["--imbalance", "10", "--seeds", "0", "1", "--methods", "fedavg", "--rounds", "1"]
    try:
        done = subprocess.run(
            [
                sys.executable,
                "benchmarks/accuracy.py",
                *grid,
                "--ray",
                cluster.address,
                "--runs",
                str(tmp_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        cluster.shutdown()
    assert done.returncode == 0, done.stderr
    assert "[2/2]" in done.stdout
    results = json.loads((tmp_path / "accuracy-table.json").read_text())
    assert sorted(r["seed"] for r in results) == [0, 1]
    assert all(r["rounds"] == 1 for r in results)


def test_without_an_address_a_run_starts_its_own_cluster_beside_a_running_one(tmp_path):
    """Ray's `init()` joins the cluster `ray start` left running here; the simulator, told no address, must
    start its own (asking a running cluster for CPUs is refused)."""
    from ray.cluster_utils import Cluster

    running = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        result = run_simulation(_config(rounds=1, backend="ray", workers=2), tmp_path, echo=_quiet)
    finally:
        running.shutdown()
    assert result.state.round == 1
