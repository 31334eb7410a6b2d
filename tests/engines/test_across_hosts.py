"""A trainer and a ``vllm serve`` on two "hosts": network namespaces this test makes, joined by
a bridge. Traffic stays inside them (addresses exist only there); both are deleted after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TOLERANCE, VLLMServer
from hosts import Hosts

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).parents[1] / "across_hosts_run.py"
API_KEY = "across-hosts-test-key"


@pytest.fixture
def two_hosts():
    """Hosts ``trainer`` (10.231.7.1) and ``server`` (10.231.7.2) on one bridge (``tests/hosts.py``)."""
    hosts = Hosts(["trainer", "server"], net=7)
    try:
        yield hosts.namespaces["trainer"], hosts.namespaces["server"]
    finally:
        hosts.close()


def test_a_trainer_pushes_to_a_server_on_another_host(two_hosts, served_model_dir, tmp_path):
    trainer_ns, server_ns = two_hosts
    server = VLLMServer(served_model_dir, tmp_path / "server.log", api_key=API_KEY, host="10.231.7.2", netns=server_ns)
    try:
        out = tmp_path / "trainer.json"
        env = {**os.environ, "TEST_API_KEY": API_KEY}
        env.pop("VLLM_API_KEY", None)
        completed = subprocess.run(
            ["ip", "netns", "exec", trainer_ns, sys.executable, str(SCRIPT), server.url, "10.231.7.1", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert completed.returncode == 0, completed.stderr[-4000:] + Path(server.log.name).read_text()[-2000:]
        server_listening = subprocess.run(
            ["ip", "netns", "exec", server_ns, "ss", "-Hltn"], capture_output=True, text=True, timeout=30
        ).stdout
    finally:
        server.stop()
    result = json.loads(out.read_text())
    assert "needs an API key" in result["without_key"]
    assert result["logprob_gap"] < TOLERANCE
    # The trainer listens (rendezvous store, gloo) on the address it was given, nowhere else.
    assert result["listening"] and all(address.startswith("10.231.7.1:") for address in result["listening"])
    # The server's HTTP port is on its own address only.
    assert f"10.231.7.2:{server.port}" in server_listening
    assert f"0.0.0.0:{server.port}" not in server_listening and f"*:{server.port}" not in server_listening
