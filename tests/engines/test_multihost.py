"""A two-node Lightning run (one process per node, under DDP and under FSDP2) keeps ``vllm serve``
on a third host in sync. The three hosts are network namespaces on one bridge that this module
makes (``tests/hosts.py``); traffic stays on their addresses, and all are deleted afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TOLERANCE, VLLMServer
from hosts import INTERFACE, Hosts

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).parents[1] / "multihost_run.py"
API_KEY = "multihost-test-key"
# Every port of the run, as a user would choose them (each namespace is new, so all are free).
MASTER_PORT = 29510  # Lightning's (torch's) rendezvous, on node 0
SYNC_PORT = 29620  # the weight sync's rendezvous, on node 0
SERVER_PORT = 8000  # vllm serve, on the server host
STEPS = 3  # multihost_run.STEPS


@pytest.fixture(scope="module")
def cluster(served_model_dir, tmp_path_factory):
    """Hosts ``node0``, ``node1`` (the trainer's nodes) and ``server`` (``vllm serve``)."""
    hosts = Hosts(["node0", "node1", "server"], net=8)
    server = None
    try:
        log = tmp_path_factory.mktemp("multihost") / "server.log"
        server = VLLMServer(
            served_model_dir,
            log,
            api_key=API_KEY,
            host=hosts.address("server"),
            port=SERVER_PORT,
            netns=hosts.namespaces["server"],
        )
        wait_until_healthy_from(hosts, "node0", server)
        yield hosts, server
    finally:
        if server is not None:
            server.stop()
        hosts.close()


def wait_until_healthy_from(hosts: Hosts, name: str, server: VLLMServer) -> None:
    """Wait (bounded) until ``server`` answers from host ``name``: this process, outside every
    namespace, has no route to it."""
    wait = (  # the standard library only: importing the test helpers would cost seconds
        "import time, urllib.request\n"
        "deadline = time.monotonic() + 240\n"
        "while True:\n"
        "    try:\n"
        f"        urllib.request.urlopen({server.url + '/health'!r}, timeout=2)\n"
        "        break\n"
        "    except OSError:\n"
        "        assert time.monotonic() < deadline, 'not healthy within 240 s'\n"
        "        time.sleep(1)\n"
    )
    command = hosts.command(name, [sys.executable, "-c", wait])
    completed = subprocess.run(command, cwd=SCRIPT.parent, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:] + Path(server.log.name).read_text()[-2000:]


def process_state(pid: int) -> str:
    """The state letter of a process (``T``: stopped), or ``""`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def run_two_nodes(hosts: Hosts, server: VLLMServer, strategy: str, out_dir: Path) -> tuple[list[dict], set[str]]:
    """Start one process per node with Lightning's own environment; returns each rank's record
    and every socket seen listening on the server's host while they ran (sampled each second)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(
        VLLM_API_KEY=API_KEY,
        MASTER_ADDR=hosts.address("node0"),
        MASTER_PORT=str(MASTER_PORT),
        GLOO_SOCKET_IFNAME=INTERFACE,
    )
    command = [sys.executable, str(SCRIPT), strategy, server.url, str(SYNC_PORT), str(out_dir)]
    nodes = [
        hosts.start(f"node{rank}", command, {**env, "NODE_RANK": str(rank)}, out_dir / f"node{rank}.log")
        for rank in (0, 1)
    ]
    server_listening: set[str] = set()
    deadline = time.monotonic() + 300
    stops = strategy == "fsdp2"  # node 1 ends by stopping itself half way through a push: it is killed then
    try:
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            server_listening |= {f"{listener.address}:{listener.port}" for listener in hosts.listening("server")}
            if stops and process_state(nodes[1].pid) == "T":
                time.sleep(1)  # rank 0 is waiting for it
                nodes[1].kill()
            time.sleep(1)
        for node_rank, node in enumerate(nodes):
            code = node.poll()
            assert code == (-9 if stops and node_rank == 1 else 0), (
                f"node {node_rank} exited with {code}:\n" + (out_dir / f"node{node_rank}.log").read_text()[-4000:]
            )
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=30)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)], server_listening


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_two_node_run_keeps_a_server_on_a_third_host_in_sync(cluster, strategy, tmp_path):
    hosts, server = cluster
    ranks, server_listening = run_two_nodes(hosts, server, strategy, tmp_path)
    first_version = ranks[0]["version_before"]

    assert [rank["global_rank"] for rank in ranks] == [0, 1]
    assert {rank["world_size"] for rank in ranks} == {2}
    # A push at fit start and after every step, counted on both nodes; every rollout on both
    # nodes came from the weights its rank's trainer held (staleness 0), prompts per rank.
    final = first_version + 1 + STEPS
    assert [rank["weight_version"] for rank in ranks] == [final, final]
    assert ranks[0]["served_version"] == final
    assert "needs an API key" in ranks[0]["without_key"]  # and nothing was pushed with it
    assert ranks[0]["logprob_gap"] < TOLERANCE
    for rank in ranks:
        assert len(rank["seen"]) == STEPS
        for _, prompts, _, _, versions, trainer_version in rank["seen"]:
            assert set(versions) == {trainer_version}
            assert prompts[0][0] == 1 + rank["global_rank"]
        assert [step[5] for step in rank["seen"]] == list(range(first_version + 1, final))
    # TensorBoard is written on node 0 alone.
    assert ranks[0]["weight_version_scalars"] == [float(v) for v in range(first_version + 1, final + 1)]
    assert ranks[1]["event_files"] == 0

    # The weight sync's rendezvous listens on node 0's address, on the port the user chose; the
    # other sockets of the trainer's nodes are torch's (Lightning's process group, the status
    # group), on each node's own address, except torch's store on MASTER_PORT.
    for rank, name in zip(ranks, ("node0", "node1")):
        for address in rank["listening"]:
            assert address == f"*:{MASTER_PORT}" or address.startswith(f"{hosts.address(name)}:"), address
    assert f"{hosts.address('node0')}:{SYNC_PORT}" in ranks[0]["listening"]
    assert not any(address.endswith(f":{SYNC_PORT}") for address in ranks[1]["listening"])
    # Under FSDP2 every rank sends its own shard (push_from="every_rank"): rank 1 meets the server's
    # workers on the next port, master_port + 1, at its own node's address; under DDP it listens on none.
    sends_shares = f"{hosts.address('node1')}:{SYNC_PORT + 1}" in ranks[1]["listening"]
    assert sends_shares == (strategy == "fsdp2")
    if strategy == "fsdp2":
        # Rank 1 cannot listen (its port is taken): both ranks fail with its error before vLLM is touched.
        failed = [rank["failed_share"] for rank in ranks]
        assert failed[1]["cannot_listen"].startswith(f"WeightSyncError: Cannot listen on {hosts.address('node1')}:")
        named = failed[1]["cannot_listen"]
        assert failed[0]["cannot_listen"] == f"PushAborted: The push failed on trainer rank 1: {named}"
        # Rank 1 fails half way through its shares: both ranks fail with its error, the server keeps
        # the trained weights it had, and the next push goes through.
        assert failed[1]["failure"] == "RuntimeError: rank 1 lost its shard"
        assert failed[0]["failure"] == f"PushAborted: The push failed on trainer rank 1: {failed[1]['failure']}"
        assert failed[0]["served_after_failure"] == final and failed[0]["gap_after_failure"] < TOLERANCE
        assert max(rank["failure_seconds"] for rank in failed) < 30
        assert failed[0]["weight_version"] == failed[1]["weight_version"] == failed[0]["served_after_retry"] > final
        assert failed[0]["gap_after_retry"] < TOLERANCE
        # Last, rank 1 stops itself (SIGSTOP) half way through its share of a push of changed weights, and
        # is killed (SIGKILL): rank 0 fails within its bounds, the server keeps the weights it had.
        killed = json.loads((tmp_path / "rank0-killed.json").read_text())
        assert killed["failure"].startswith("WeightSyncError: Rank 0 lost the other trainer ranks during a push")
        assert killed["failure_seconds"] < 15, killed  # (the test kills rank 1 a second after it stopped)
        assert killed["served"] == failed[0]["served_after_retry"] and killed["gap_to_trained"] < TOLERANCE
        assert killed["gap_to_changed"] > 1e-3  # the push would have changed what it serves
    # While the nodes ran, the server's host listened on the server's port alone: vLLM's own
    # sockets are on loopback, and its workers connected out to the trainer for every push.
    assert f"{hosts.address('server')}:{SERVER_PORT}" in server_listening
    assert {address for address in server_listening if not address.startswith("127.0.0.1:")} == {
        f"{hosts.address('server')}:{SERVER_PORT}"
    }
    print(f"{strategy}: node0 {ranks[0]['listening']} node1 {ranks[1]['listening']} server {sorted(server_listening)}")
