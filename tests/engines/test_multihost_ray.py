"""A real Ray cluster across two "hosts": the head (where the trainer runs as the driver) and an
inference host, where Ray places the vLLM actor. Both are network namespaces on one bridge
made here (``tests/hosts.py``), every Ray port is chosen (``tests/ray_nodes.py``), and all is
deleted afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import TOLERANCE
from hosts import Hosts
from ray_nodes import AUTOSCALER_METRIC_PORT, CLIENT_PORT, GCS_PORT, NODE_PORTS, WORKER_PORTS, RayNode, ray_environment

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).parents[1] / "multihost_ray_run.py"
SYNC_PORT = 29630  # the weight sync's rendezvous, on the head (the trainer's host)


def wait_for_nodes(hosts: Hosts, auth: dict[str, str], count: int, timeout: float = 120) -> None:
    """Wait (bounded) until the cluster has ``count`` live nodes, asked from the head host."""
    ask = (
        "import ray, time, sys\n"
        f"ray.init(address='{hosts.address('head')}:{GCS_PORT}', log_to_driver=False, configure_logging=False)\n"
        f"deadline = time.monotonic() + {timeout}\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
        "    assert time.monotonic() < deadline, ray.nodes()\n"
        "    time.sleep(1)\n"
    )
    completed = subprocess.run(
        hosts.command("head", [sys.executable, "-c", ask]),
        env={**os.environ, **auth},
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]


def commands(listener) -> list[str]:
    """The command lines of the processes holding ``listener`` (for the failure message)."""
    lines = []
    for pid in listener.pids:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300])
        except OSError:
            lines.append(f"{pid}: gone")
    return lines


@pytest.fixture
def ray_cluster(tmp_path):
    # Short: Ray's unix socket paths under it must stay within the kernel's 107 characters.
    temp_dir = Path(tempfile.mkdtemp(prefix="lvray-"))
    hosts = Hosts(["head", "inference"], net=9)
    auth = ray_environment(tmp_path / "ray_token")
    nodes = []
    try:
        nodes.append(RayNode(hosts, "head", tmp_path / "head.log", environment=auth, temp_dir=temp_dir, num_cpus=1))
        nodes.append(
            RayNode(
                hosts,
                "inference",
                tmp_path / "inference.log",
                environment=auth,
                temp_dir=temp_dir,
                head=hosts.address("head"),
                num_cpus=2,
                resources={"inference_host": 2},
            )
        )
        wait_for_nodes(hosts, auth, 2)
        yield hosts, auth
    finally:
        try:
            for node in reversed(nodes):
                node.stop()
        finally:
            hosts.close()
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_trainer_drives_a_vllm_actor_that_ray_placed_on_another_host(ray_cluster, served_model_dir, tmp_path):
    hosts, auth = ray_cluster
    out = tmp_path / "driver.json"
    head = hosts.address("head")
    command = [sys.executable, str(SCRIPT), f"{head}:{GCS_PORT}", str(served_model_dir), head, str(SYNC_PORT), str(out)]
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}, **auth}
    completed = subprocess.run(hosts.command("head", command), env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    result = json.loads(out.read_text())

    # Ray placed both actors on the inference host, which its resource names.
    assert result["actor_host"] == hosts.address("inference")
    assert result["replacement_host"] == hosts.address("inference")
    # Rollouts through the actor in steps 0-2 came from the trainer's own version; the push
    # point of step 2 met the dead actor (a warning, one failure), and the user's replacement
    # took the push point of step 3: it serves the trained weights and the trainer's version.
    assert [(versions, trainer) for _, versions, trainer in result["seen"]] == [([v, v], v) for v in (1, 2, 3)]
    assert result["sync_failures"] == 1 and result["replacements"] == 1
    assert result["replacement_version"] == result["weight_version"]
    assert result["replacement_gap"] < TOLERANCE
    # With on_sync_error="raise", the push point after the death ends the fit with an error
    # that names the dead actor.
    assert result["raised"] is not None and "Ray actor" in result["raised"]
    assert result["steps_run_before_the_error"] == 2

    # Every port a process listens on, in both hosts, is one chosen in ray_nodes.py or here
    # (vLLM's engine core and workers listen on loopback only, on ports of vLLM's choosing).
    chosen = {GCS_PORT, CLIENT_PORT, AUTOSCALER_METRIC_PORT, SYNC_PORT, *NODE_PORTS.values(), *WORKER_PORTS}
    for name in ("head", "inference"):
        for listener in hosts.listening(name):
            assert listener.address == "127.0.0.1" or listener.port in chosen, (name, str(listener), commands(listener))
    assert all(int(address.rsplit(":", 1)[1]) in chosen for address in result["driver_listening"])
