"""A real Ray cluster across the "hosts" of ``tests/hosts.py``: the head in one namespace,
workers in others, every port of every node chosen here (``ray start`` takes them all).

Each node is a ``ray start --block`` in a session of its own, so that stopping it (the
session's process group) stops its raylet, its GCS and its workers, and nothing else:
``ray stop`` would kill every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from hosts import Hosts

GCS_PORT = 6380  # the head's; what drivers and workers join
CLIENT_PORT = 10001  # Ray Client's server, on the head
AUTOSCALER_METRIC_PORT = 6387  # the head's autoscaler metrics (an environment variable, not an option)
NODE_PORTS = {  # the same on every node: each host has its own addresses
    "--node-manager-port": 6381,
    "--object-manager-port": 6382,
    "--dashboard-agent-listen-port": 6383,
    "--dashboard-agent-grpc-port": 6384,
    "--metrics-export-port": 6385,
    "--runtime-env-agent-port": 6386,
    "--min-worker-port": 10002,
    "--max-worker-port": 10031,
}
WORKER_PORTS = range(10002, 10032)  # where Ray's worker processes (actors, drivers) listen


def ray_environment(token_path: Path) -> dict[str, str]:
    """The environment of every process of the cluster, drivers included.

    Ray's token authentication (on by default for new clusters in Ray 2.60) with a token of
    this test's own, kept beside its files rather than in ``~/.ray``; and the one port that
    ``ray start`` takes no option for: the head's autoscaler metrics (all interfaces, 44217
    unless ``AUTOSCALER_METRIC_PORT`` says otherwise).
    """
    if not token_path.exists():
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_path),
        "RAY_USAGE_STATS_ENABLED": "0",
        "AUTOSCALER_METRIC_PORT": str(AUTOSCALER_METRIC_PORT),
    }


def ray_binary() -> str:
    return str(Path(sys.executable).with_name("ray"))


class RayNode:
    """One ``ray start --block`` inside host ``name`` (the head when ``head`` is None)."""

    def __init__(
        self,
        hosts: Hosts,
        name: str,
        log_path: Path,
        *,
        environment: dict[str, str],
        temp_dir: Path,
        head: str | None = None,
        num_cpus: int = 1,
        resources=None,
    ) -> None:
        address = hosts.address(name)
        command = [ray_binary(), "start", "--block", "--node-ip-address", address, "--num-cpus", str(num_cpus)]
        # Its sessions and its address file go here, not to /tmp/ray: a ray.init() without an
        # address (as test_ray.py's) would otherwise try to join this cluster once it is gone.
        command += ["--temp-dir", str(temp_dir)]
        command += ["--disable-usage-stats"]
        for option, port in NODE_PORTS.items():
            command += [option, str(port)]
        if head is None:
            command += ["--head", "--port", str(GCS_PORT), "--ray-client-server-port", str(CLIENT_PORT)]
            command += ["--include-dashboard", "false"]
        else:
            command += ["--address", f"{head}:{GCS_PORT}"]
        if resources:
            command += ["--resources", json.dumps(resources)]
        env = {**os.environ, **environment}
        self.address = address
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            hosts.command(name, command), env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self) -> None:
        """SIGTERM the node's session (Ray's own shutdown), then SIGKILL what is left after 5 s: the node holding
        vLLM's actor did not end on SIGTERM within 20 s (the whole wait, at every run of the engine tier), and a
        test's node holds nothing to save.

        Raises:
            AssertionError: the node left the address of its cluster in /tmp/ray, where a later
                ``ray.init()`` on this machine would find it (the file is removed first).
        """
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                time.sleep(0.2)
                self.process.poll()
        self.log.close()
        stale = Path("/tmp/ray/ray_current_cluster")
        if stale.exists() and stale.read_text().startswith(f"{self.address}:"):
            stale.unlink()
            raise AssertionError(f"ray start --temp-dir did not keep the cluster's address out of {stale}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
