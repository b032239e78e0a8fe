"""The trainer attached to a running Ray cluster (`trainer.ray_address`): two nodes made by two
real `ray start` processes on this host, one CPU each, so the two workers must go one per node.

A first driver takes one step, saves a checkpoint and is SIGKILLed; a second driver attaches to
the same cluster, resumes, and takes the next step. Each step must equal the same step in one
local process, and the cluster must outlive both drivers. The drivers
(`tests/trainer/cluster_driver.py`) run in their own processes, and so does every other
connection to the cluster: Ray keeps its authentication state per process, and this one must
not take any from the cluster.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.servers import free_port
from tests.trainer import test_update
from tests.trainer.policy_batch import policy_batch
from tests.trainer.test_update import settings
from trainer.update import PolicyUpdater

pytestmark = test_update.pytestmark  # verl's import-time warnings, allowed as in the other update tests

ROOT = Path(__file__).resolve().parents[2]
# Rendezvous variables an in-process updater leaves in this process's environment, and Ray's own
# (a local `ray.init` sets RAY_AUTH_MODE here): the cluster and its drivers get neither.
_INHERITED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS", "RAY_AUTH_MODE",
              "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_DRIVER_TIMEOUT_S = 240


@dataclass
class RayCluster:
    address: str
    nodes: list[subprocess.Popen[bytes]]
    temp_dir: Path
    # Token authentication, as a production cluster runs, with a token of its own: what a
    # trainer attaching by HOST:PORT needs (docs/scale.md), and nothing from ~/.ray.
    env: dict[str, str]

    def alive_node_ids(self) -> list[str]:
        """Alive node ids, as a fresh driver connected to the cluster sees them."""
        out = subprocess.run([sys.executable, "-m", "tests.trainer.cluster_driver", "nodes", self.address],
                             cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        nodes: list[str] = json.loads(out.stdout)
        return nodes

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.temp_dir.glob("*.log")))


def _ray_start(cluster: RayCluster, name: str, *args: str) -> subprocess.Popen[bytes]:
    """One Ray node, its output in `temp_dir/<name>.log`. `--block` keeps the node's processes tied to
    this one: SIGTERM to it stops this node alone, where `ray stop` kills every Ray process on the host."""
    ray = str(Path(sys.executable).with_name("ray"))
    ports = ["--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port())]
    with (cluster.temp_dir / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            [ray, "start", "--block", "--num-cpus", "1", "--object-store-memory", str(100 << 20),
             "--disable-usage-stats", "--include-log-monitor", "false", *ports, *args],
            stdout=log, stderr=subprocess.STDOUT, env=cluster.env, cwd=ROOT,
        )


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[RayCluster]:
    """A head node and a worker node on this host, 1 CPU each, with their own temp dir and ports,
    so no other Ray on the machine is touched."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rolltap-ray-"))  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED} | {
        "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    cluster = RayCluster(f"127.0.0.1:{port}", [], temp_dir, env)
    try:
        cluster.nodes.append(_ray_start(
            cluster, "head", "--head", "--port", str(port), "--temp-dir", str(temp_dir), "--include-dashboard",
            "false", "--ray-client-server-port", str(free_port())))
        deadline = time.monotonic() + 60
        while "Ray runtime started" not in (temp_dir / "head.log").read_text():
            assert cluster.nodes[0].poll() is None and time.monotonic() < deadline, cluster.logs()
            time.sleep(0.5)
        cluster.nodes.append(_ray_start(cluster, "node", "--address", cluster.address))
        while len(cluster.alive_node_ids()) < 2:
            assert all(p.poll() is None for p in cluster.nodes) and time.monotonic() < deadline, cluster.logs()
            time.sleep(1)
        yield cluster
    finally:
        for node in reversed(cluster.nodes):  # the worker node first, then the head (and its GCS)
            node.send_signal(signal.SIGTERM)
        for node in cluster.nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _driver(cluster: RayCluster, phase: str, model_dir: Path, checkpoints: Path, out: Path,
            log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as log_file:  # a file, not a pipe: the workers' logs reach the driver's output
        return subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.cluster_driver", phase, cluster.address, str(model_dir),
             str(checkpoints), str(out)],
            cwd=ROOT, env=cluster.env, stdout=log_file, stderr=subprocess.STDOUT,
        )


def _wait_for(driver: subprocess.Popen[bytes], out: Path, log: Path, cluster: RayCluster) -> dict[str, Any]:
    """The driver's results once it has written them; fails, with the logs, if it exits first or hangs."""
    deadline = time.monotonic() + _DRIVER_TIMEOUT_S
    while not out.exists():
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            pytest.fail(f"driver exited {driver.wait()} before writing {out.name}:\n{log.read_text()[-5000:]}\n"
                        f"{cluster.logs()}")
        time.sleep(1)
    result: dict[str, Any] = torch.load(out)
    return result


def _assert_step_matches(got: dict[str, float], state: dict[str, Any], expected: dict[str, float],
                         expected_state: dict[str, Any]) -> None:
    """The same comparison as test_update_ray: metrics, parameters and Adam's moments of one step."""
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "tokens", "adv_mean", "is_weight_mean", "step"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert state["params"].keys() == expected_state["params"].keys()
    for name, value in expected_state["params"].items():
        torch.testing.assert_close(state["params"][name], value, atol=1e-5, rtol=0,
                                   msg=functools.partial("{}: {}".format, name))  # the name, then torch's message
    for name, slots in expected_state["optim"]["state"].items():
        torch.testing.assert_close(state["optim"]["state"][name]["exp_avg"], slots["exp_avg"], atol=1e-7, rtol=1e-4)


def test_trainer_attached_to_a_two_node_cluster_resumes_after_a_kill(two_nodes: RayCluster, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    batch = policy_batch(tiny_model_dir, copies=2, mini_batch_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker (1 CPU): the same summation order inside matmuls
    try:
        local = PolicyUpdater(tiny_model_dir, settings())
        # a copy: in one CPU process the state's tensors are the live parameters, which the next step changes
        expected = [local.update(batch), copy.deepcopy(local.training_state())]
        expected += [local.update(batch), local.training_state()]
    finally:
        torch.set_num_threads(threads)
    checkpoints = tmp_path / "checkpoints"

    # The first driver: attach, step, checkpoint; then SIGKILL, as a crash or an OOM kill would.
    driver = _driver(two_nodes, "first", tiny_model_dir, checkpoints, tmp_path / "first.pt", tmp_path / "first.log")
    try:
        first = _wait_for(driver, tmp_path / "first.pt", tmp_path / "first.log", two_nodes)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    # (a) the workers ran one per node: the cluster's two nodes, by their own report
    nodes = two_nodes.alive_node_ids()
    assert len(nodes) == 2 and sorted(first["nodes"]) == nodes
    # (b) the step equals the same step in one local process
    _assert_step_matches(first["metrics"], first["state"], expected[0], expected[1])
    # (c) a complete checkpoint of step 1, one shard per rank
    saved = checkpoints / "step_00000001"
    assert (checkpoints / "latest").read_text().strip() == saved.name
    assert json.loads((saved / "rolltap_checkpoint.json").read_text())["step"] == 1
    assert sorted(p.name for p in saved.glob("model_world_size_2_rank_*.pt")) == [
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]

    # (d) a new driver on the same cluster resumes the killed one's run
    driver = _driver(two_nodes, "resume", tiny_model_dir, checkpoints, tmp_path / "resume.pt",
                     tmp_path / "resume.log")
    try:
        resumed = _wait_for(driver, tmp_path / "resume.pt", tmp_path / "resume.log", two_nodes)
        assert driver.wait(timeout=60) == 0
    finally:
        driver.kill()
    assert sorted(resumed["nodes"]) == nodes
    assert resumed["resumed_step"] == 1
    for name, value in first["state"]["params"].items():
        assert torch.equal(resumed["resumed_state"]["params"][name], value), name
    # the next step continues the killed run's optimizer: it equals the local second step
    _assert_step_matches(resumed["metrics"], resumed["state"], expected[2], expected[3])

    # neither the kill nor the second driver's exit stopped the cluster
    assert all(p.poll() is None for p in two_nodes.nodes)
    assert two_nodes.alive_node_ids() == nodes
