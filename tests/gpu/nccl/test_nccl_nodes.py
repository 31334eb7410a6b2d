"""Trainers in processes of their own push into ``vllm serve`` over ``nccl`` on the one GPU, every process an NCCL
host of its own (``nccl_hosts.py``): ``Trainer.fit`` in this process through the server's URL; a two-node Lightning
run (DDP, FSDP2) whose ranks both sample and whose pushes outlive a rank failing half way (``two_nodes_run.py``);
a trainer killed in the middle of a push (``killed_trainer_run.py``), after which the server must serve again and
take the next trainer's push. Every wait is bounded, so a server left blocked in its NCCL receive shows as a
failure that says so, not as a hang. Each subprocess's log goes to ``$OUT`` (or the test's ``tmp_path``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import killed_trainer_run
import pytest
import two_nodes_run
from gpu_helpers import FIGURES, gpu_trainer, hf_prompt_logprobs, what_it_serves
from helpers import (
    TinyCausalLM,
    engine_prompt_logprobs,
    free_port,
    max_abs_diff,
    tiny_qwen2,
    token_batches,
)
from killed_trainers import ANSWER_MARGIN_SECONDS, kill_when_stopped, logs_dir, next_trainer_pushes, serves_again
from nccl_hosts import host_env
from scenarios import FLOOR_BOUND

from lightning_vllm import HTTPEngine, VLLMWeightSync
from lightning_vllm.engines.base import version_number

pytestmark = pytest.mark.gpu

NODES_SECONDS = 300.0
"""The longest the two nodes may run: a fit of a few steps, then pushes each bounded by ``TrainerRanks``."""


def test_fit_in_this_process_lands_in_the_server_within_the_engines_own_float32_floor(nccl_server, tmp_path):
    engine = HTTPEngine(nccl_server.url)
    assert engine.transfer_backend() == "nccl"  # its /server_info says so
    start = version_number(engine.get_weight_version())
    module = TinyCausalLM(tiny_qwen2(seed=30), lr=1e-2)
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1)

    gpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))

    gap = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(module.hf))
    FIGURES["nccl_serve_fit_gap"] = gap
    assert gap <= FLOOR_BOUND, gap
    assert engine.get_weight_version() == str(sync.weight_version) == str(start + 3)  # fit start, steps 1 and 2


def run_two_nodes(url: str, strategy: str, out_dir: Path) -> list[dict[str, Any]]:
    """One process per node, each with Lightning's own environment and an NCCL host of its own; every rank's
    record once both exited (at most :data:`NODES_SECONDS`; both are killed in any case)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "NCCL_HOSTID")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    command = [sys.executable, str(two_nodes_run.__file__), strategy, url, str(out_dir)]
    logs = [out_dir / f"node{rank}.log" for rank in (0, 1)]
    nodes: list[subprocess.Popen] = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as output:
                node_env = {**env, "NODE_RANK": str(rank), **host_env(f"node{rank}")}
                nodes.append(subprocess.Popen(command, env=node_env, stdout=output, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + NODES_SECONDS
        for rank, node in enumerate(nodes):
            try:
                code: int | str = node.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = f"nothing: still running after {NODES_SECONDS:g} s"
            assert code == 0, f"node {rank} exited with {code}:\n" + logs[rank].read_text()[-4000:]
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=30)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_two_node_run_keeps_the_server_in_sync_and_outlives_a_rank_failing_mid_push(nccl_server, strategy, tmp_path):
    ranks = run_two_nodes(nccl_server.url, strategy, logs_dir(tmp_path) / f"two-nodes-{strategy}")
    failures = [rank["rank_failures"] for rank in ranks]
    FIGURES[f"two_nodes_{strategy}"] = {
        "logprob_gap": ranks[0]["logprob_gap"],
        "rank0": failures[0],
        "rank1": failures[1],
    }
    first = ranks[0]["version_before"]
    final = first + 1 + two_nodes_run.STEPS

    assert [rank["global_rank"] for rank in ranks] == [0, 1]
    assert {rank["world_size"] for rank in ranks} == {2}
    # A push at fit start and after every step, counted on both nodes; every rollout on both nodes came from the
    # weights its rank's trainer held (staleness 0), prompts per rank.
    assert [rank["weight_version"] for rank in ranks] == [final, final]
    assert ranks[0]["served_version"] == final
    assert ranks[0]["logprob_gap"] <= FLOOR_BOUND, ranks[0]["logprob_gap"]
    for rank in ranks:
        assert len(rank["seen"]) == two_nodes_run.STEPS
        for _, prompts, _, _, versions, trainer_version in rank["seen"]:
            assert set(versions) == {trainer_version}
            assert prompts[0][0] == 1 + rank["global_rank"]
        assert [step[5] for step in rank["seen"]] == list(range(first + 1, final))
    assert ranks[0]["weight_version_scalars"] == [float(v) for v in range(first + 1, final + 1)]
    assert ranks[1]["event_files"] == 0  # TensorBoard is written on node 0 alone

    # Rank 1 fails after its first layer group, then rank 0 half way through its tensors: both ranks fail in
    # time, the peer with the failing rank's error; the server still serves, its version unchanged (what it
    # serves is recorded: nccl loads as it receives, so a push that failed half way may leave a mix).
    for failing_rank, case in ((1, "rank1_fails"), (0, "rank0_fails")):
        own, peer = failures[failing_rank][case], failures[1 - failing_rank][case]
        assert f"rank {failing_rank} " in own["failure"], own
        assert peer["failure"] == f"PushAborted: The push failed on trainer rank {failing_rank}: {own['failure']}"
        # (timeout_seconds and a few: each rank fails at its next check-in, not at a wait's end)
        assert max(own["failure_seconds"], peer["failure_seconds"]) < two_nodes_run.TIMEOUT_SECONDS + 5, (own, peer)
        served = failures[0][case]["served"]
        assert "error" not in served and served["version"] == final, served
    # The next push goes through on both ranks and is served.
    assert [failure["next_push"].get("failure") for failure in failures] == [None, None]
    served = failures[0]["next_push"]["served"]
    assert failures[0]["weight_version"] == failures[1]["weight_version"] == served["version"] > final, served
    assert served["gap_to_pushed"] <= FLOOR_BOUND, served


@pytest.mark.ends_engine  # a server left blocked in its NCCL receive would fail the tests after this one
def test_a_trainer_killed_mid_push_leaves_the_server_serving_and_the_next_trainer_lands(nccl_server, tmp_path):
    url = nccl_server.url
    record = tmp_path / "killed-trainer.json"
    kill_when_stopped(url, record, logs_dir(tmp_path) / "killed-trainer.log", "half-way")
    killed_at = time.monotonic()
    landed = json.loads(record.read_text())["landed_version"]

    within = killed_trainer_run.TIMEOUT_SECONDS + ANSWER_MARGIN_SECONDS
    figures: dict[str, Any] = {"landed_version": landed, "answered": serves_again(url, killed_at, within)}
    FIGURES["failure_trainer_killed"] = figures  # (kept whatever fails below)
    before, killed = tiny_qwen2(seed=killed_trainer_run.LANDED_SEED), tiny_qwen2(seed=killed_trainer_run.KILLED_SEED)
    engine = HTTPEngine(url, timeout_seconds=5.0, generate_timeout_seconds=30.0)
    figures["in_between"] = what_it_serves(engine, before, killed)
    next_model = tiny_qwen2(seed=63).cuda()
    figures["next_trainer"] = next_trainer_pushes(url, next_model)
    if any("landed" in attempt for attempt in figures["next_trainer"].values()):
        figures["next_served"] = what_it_serves(engine, before, next_model)
    print(f"trainer killed mid-push: {figures}")

    assert "seconds" in figures["answered"], figures["answered"]  # within timeout_seconds + a few
    assert figures["in_between"].get("version") == landed, figures["in_between"]  # the killed push not committed
    assert figures["next_trainer"]["first"].get("landed") == landed + 1, figures["next_trainer"]
    assert figures["next_served"]["version"] == landed + 1, figures["next_served"]
    assert figures["next_served"]["gap_to_pushed"] <= FLOOR_BOUND, figures["next_served"]
