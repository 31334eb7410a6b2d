"""A trainer and a ``vllm serve`` on two "hosts": network namespaces this test makes, joined by
a veth pair. Traffic stays inside them (addresses exist only there); both are deleted after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import TOLERANCE, VLLMServer

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).parents[1] / "across_hosts_run.py"
API_KEY = "across-hosts-test-key"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces ``trainer`` (10.231.7.1) and ``server`` (10.231.7.2) on one veth link."""
    tag = uuid.uuid4().hex[:6]
    trainer, server = f"lv-trainer-{tag}", f"lv-server-{tag}"
    try:
        ip("netns", "add", trainer)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot make network namespaces here (needs root and iproute2): {error}")
    try:
        ip("netns", "add", server)
        ip("link", "add", f"lvt{tag}", "netns", trainer, "type", "veth", "peer", "name", f"lvs{tag}", "netns", server)
        for namespace, device, address in ((trainer, f"lvt{tag}", "10.231.7.1"), (server, f"lvs{tag}", "10.231.7.2")):
            ip("-n", namespace, "addr", "add", f"{address}/30", "dev", device)
            ip("-n", namespace, "link", "set", device, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield trainer, server
    finally:
        for namespace in (trainer, server):  # deleting a namespace deletes its end of the link
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


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
