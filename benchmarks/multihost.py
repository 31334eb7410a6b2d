"""Multi-host pushes from an FSDP2 policy (``make bench-multihost``): rank 0 sends, or every rank sends.

Three "hosts" on this machine (network namespaces on one bridge, ``tests/hosts.py``): ``vllm serve``
on ``server``, one trainer process on each of ``node0`` and ``node1`` (``multihost_node.py``, a gloo
world of 2, the policy sharded with FSDP2). Each node's egress is shaped to ``--rate`` (tc tbf),
and the nodes push the model alternately with ``push_from="rank0"`` (every rank gathers, rank 0
sends everything) and ``"every_rank"`` (each rank sends its own shard), one untimed push of each
first, then ``--rounds`` timed rounds; then the limit is lifted and both are timed again. Last,
an ``every_rank`` push of moved weights, then a ``rank0`` push of the same, are checked against the
gathered model's prompt logprobs and against each other.

Prints ``multihost: every_rank_over_rank0=X`` (median rank-0 seconds over median every-rank
seconds under the limit) and ``multihost_full_speed: every_rank_over_rank0=Y``, and rewrites
its section of ``docs/benchmarks.md``. Needs root and iproute2 (``ip``, ``tc``, ``ss``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPOSITORY = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(REPOSITORY / "tests"))

from models import SIZES, build_model, save  # noqa: E402
from multihost_node import MODES  # noqa: E402  # the nodes push in these modes; the table shows each
from report import command_line, measured_on, replace_results  # noqa: E402

NODE_SCRIPT = BENCHMARKS / "multihost_node.py"
MULTIHOST_START = "<!-- multihost:start -->"
MULTIHOST_END = "<!-- multihost:end -->"
# Every port of the run, chosen (each namespace is new, so all are free).
MASTER_PORT = 29530  # torch's rendezvous, on node 0
SYNC_PORT = 29640  # the weight sync's, on node 0; with every_rank, rank 1 listens on SYNC_PORT + 1 on node 1
SERVER_PORT = 8000  # vllm serve, on the server host
NET = 10  # 10.231.10.0/24: the tests use nets 8 and 9
PHASES = ("limited", "full_speed")


def requirements_missing() -> str | None:
    """Why this machine cannot run the benchmark, or ``None``."""
    if os.geteuid() != 0:
        return "it makes network namespaces and shapes their links: run it as root"
    missing = [tool for tool in ("ip", "tc", "ss") if shutil.which(tool) is None]
    return f"it needs iproute2 ({', '.join(missing)} not found)" if missing else None


def unlimit(hosts, name: str) -> None:
    """Remove the shaping ``hosts.limit`` put on host ``name``'s egress."""
    from hosts import INTERFACE

    command = hosts.command(name, ["tc", "qdisc", "del", "dev", INTERFACE, "root"])
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def prepare_model(size: str, directory: Path) -> Path:
    """The benchmark's model in float32 (the nodes build the same one) with the test tokenizer beside it:
    the server needs one to answer ``/v1/completions``."""
    from helpers import save_tokenizer

    save(build_model(SIZES[size]).float(), directory)
    return save_tokenizer(directory)


def start_nodes(hosts, url: str, out_dir: Path, args: argparse.Namespace) -> list[subprocess.Popen]:
    from hosts import INTERFACE

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(MASTER_ADDR=hosts.address("node0"), MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME=INTERFACE)
    command = [sys.executable, str(NODE_SCRIPT), url, str(SYNC_PORT), str(out_dir)]
    command += ["--size", args.size, "--rounds", str(args.rounds)]
    return [
        hosts.start(f"node{rank}", command, {**env, "NODE_RANK": str(rank)}, out_dir / f"node{rank}.log")
        for rank in (0, 1)
    ]


def supervise(hosts, server, nodes: list[subprocess.Popen], out_dir: Path, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) for both nodes to finish; lift the limit between the phases.

    Raises:
        RuntimeError: a node failed, the server exited, or the run took too long.
    """
    deadline = time.monotonic() + timeout
    shown = 0
    while any(node.poll() is None for node in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the nodes did not finish within {timeout:g} s:\n" + node_log(out_dir, 0))
        if server.process.poll() is not None:
            log = Path(server.log.name).read_text()[-4000:]
            raise RuntimeError(f"vllm serve exited with {server.process.returncode}:\n{log}")
        for rank, node in enumerate(nodes):
            if node.poll() not in (None, 0):
                raise RuntimeError(f"node {rank} exited with {node.returncode}:\n" + node_log(out_dir, rank))
        shown = show_progress(out_dir, shown)
        if (out_dir / "limited.done").exists() and not (out_dir / "unlimited").exists():
            for name in ("node0", "node1"):
                unlimit(hosts, name)
            (out_dir / "unlimited").touch()
            print("   limit lifted", flush=True)
        time.sleep(0.5)
    show_progress(out_dir, shown)
    for rank, node in enumerate(nodes):
        if node.returncode != 0:
            raise RuntimeError(f"node {rank} exited with {node.returncode}:\n" + node_log(out_dir, rank))


def node_log(out_dir: Path, rank: int) -> str:
    return (out_dir / f"node{rank}.log").read_text()[-4000:]


def show_progress(out_dir: Path, shown: int) -> int:
    """Echo node 0's new progress lines (its rounds); how many lines are shown now."""
    lines = [line for line in (out_dir / "node0.log").read_text().splitlines() if line.startswith("   ")]
    for line in lines[shown:]:
        print(line, flush=True)
    return len(lines)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    """Hosts, server and nodes up, the pushes timed, everything down again; node 0's figures."""
    import pytest
    from helpers import VLLMServer
    from hosts import Hosts

    model_dir = prepare_model(args.size, workdir / "model")
    out_dir = workdir / "run"
    out_dir.mkdir()
    try:
        hosts = Hosts(["node0", "node1", "server"], net=NET)
    except pytest.skip.Exception as skipped:  # tests/hosts.py skips a test that cannot make namespaces
        sys.exit(f"multihost: cannot run: {skipped.msg}")
    server = None
    nodes: list[subprocess.Popen] = []
    try:
        server = VLLMServer(
            model_dir,
            workdir / "server.log",
            host=hosts.address("server"),
            port=SERVER_PORT,
            netns=hosts.namespaces["server"],
        )
        for name in ("node0", "node1"):
            hosts.limit(name, args.rate)
        # The nodes build and shard their model while the server starts; each waits for it (bounded).
        nodes = start_nodes(hosts, server.url, out_dir, args)
        supervise(hosts, server, nodes, out_dir, args.timeout)
        return json.loads((out_dir / "result.json").read_text())
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=30)
        if server is not None:
            server.stop()
        hosts.close()


def median(runs: list[dict], key: str = "seconds") -> float:
    return statistics.median(run[key] for run in runs)


def ratio(result: dict, phase: str) -> float:
    return median(result[phase]["rank0"]) / median(result[phase]["every_rank"])


def table(result: dict, rate: str) -> str:
    rows = [
        "| link limit | mode | median s | min s | max s | MB sent by node0 | MB sent by node1 | "
        "MB pushed (rank 0's stats) | rank0 / mode |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in PHASES:
        for mode in MODES:
            runs = result[phase][mode]
            seconds = [run["seconds"] for run in runs]
            sent = [statistics.median(run["host_sent_bytes"][rank] for run in runs) / 1e6 for rank in (0, 1)]
            rows.append(
                f"| {rate if phase == 'limited' else 'none'} | {mode} | {statistics.median(seconds):.3f} | "
                f"{min(seconds):.3f} | {max(seconds):.3f} | {sent[0]:.0f} | {sent[1]:.0f} | "
                f"{median(runs, 'num_bytes') / 1e6:.0f} | "
                f"{median(result[phase]['rank0']) / statistics.median(seconds):.2f} |"
            )
    return "\n".join(rows)


def lines(result: dict) -> tuple[str, str]:
    return (
        f"multihost: every_rank_over_rank0={ratio(result, 'limited'):.2f}",
        f"multihost_full_speed: every_rank_over_rank0={ratio(result, 'full_speed'):.2f}",
    )


def results_markdown(result: dict, args: argparse.Namespace, minutes: float) -> str:
    check = result["check"]
    return f"""
{measured_on()}: the {args.size} model
({result["num_parameters"] / 1e6:.0f}M parameters, float32, {result["model_bytes"] / 1e6:.0f} MB),
{args.rounds} timed rounds per phase after one untimed push of each mode, in {minutes:.1f} minutes.
Command: `{command_line("benchmarks/multihost.py")}`.

{table(result, args.rate)}

"MB sent by nodeN" is what that host's link carried during one push (its interface's counter: the
gather between the nodes and the sends to the server). The check (prompt logprobs served for
{check["prompts"]} prompts against the Hugging Face model gathered with `full_tensor()`, float32):
before it, with the weights as built, the server was {check["gap_before"]:.2g} from the model; then
every rank moved its shard by noise of scale {check["noise_scale"]:g} (the served logprobs moved by
{check["served_moved_by"]:.3g}) and pushed with `every_rank`: {check["logprob_gap"]:.2g} from the model;
the same weights pushed with `rank0`: {check["rank0_gap"]:.2g}; the two modes' served logprobs
{check["every_rank_vs_rank0"]:.2g} apart.

```
{chr(10).join(lines(result))}
```
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100M", choices=list(SIZES), help="model of benchmarks/models.py")
    parser.add_argument("--rate", default="1gbit", help="each trainer host's egress under the limit (tc syntax)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of both modes per phase (default 5)")
    parser.add_argument("--timeout", type=float, default=900.0, help="the longest the nodes may run, in seconds")
    parser.add_argument("--page", type=Path, default=REPOSITORY / "docs" / "benchmarks.md", help="the page to fill")
    args = parser.parse_args()
    if why := requirements_missing():
        sys.exit(f"multihost: cannot run: {why}.")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning_vllm_multihost_") as tmp:
        result = run(args, Path(tmp))
    markdown = results_markdown(result, args, (time.monotonic() - start) / 60)
    replace_results(args.page, markdown, MULTIHOST_START, MULTIHOST_END)
    print(markdown)
    print(f"Wrote {args.page}")
    for line in lines(result):
        print(line)


if __name__ == "__main__":
    main()
