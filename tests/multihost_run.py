"""One node of a two-node Lightning run that keeps ``vllm serve`` on a third host in sync; started
by tests/engines/test_multihost.py inside that node's network namespace, once per node.

``python multihost_run.py STRATEGY SERVER_URL SYNC_PORT OUT_DIR`` with ``STRATEGY`` ``ddp`` or
``fsdp2``; under FSDP2 every rank sends its own shard (``push_from="every_rank"``), and after the run a
push whose rank 1 fails half way through its shares must fail on both ranks and leave the server as it
was. It is launched the way users launch Lightning on a cluster, with Lightning's own
environment: ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` (and ``GLOO_SOCKET_IFNAME``, which
torch's gloo needs when the host name does not resolve to the interface between the hosts).
Both nodes sample from the server in every step; global rank 0 pushes after every step, its
rendezvous on ``MASTER_ADDR:SYNC_PORT``. Each rank writes what it saw to ``OUT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import (  # noqa: E402
    RolloutCausalLM,
    cpu_trainer,
    engine_prompt_logprobs,
    hf_prompt_logprobs,
    max_abs_diff,
    served_version,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
)
from hosts import listened_on_by  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from sharded_run import ShardedCausalLM, full_model  # noqa: E402

from lightning_vllm import EngineConfigError, HTTPEngine, VLLMUpdater, VLLMWeightSync  # noqa: E402
from lightning_vllm.fronts.lightning.every_rank import send_address  # noqa: E402
from lightning_vllm.fronts.lightning.ranks import TrainerRanks  # noqa: E402
from lightning_vllm.fronts.lightning.roles import EveryRankShares  # noqa: E402
from lightning_vllm.weights.shares import RankShares  # noqa: E402

STEPS = 3


class RecordsListeners(Callback):
    """What this process listens on at the last step, when every group of the run exists."""

    def __init__(self) -> None:
        self.listening: list[str] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == STEPS:
            self.listening = listened_on_by(os.getpid())


def main(strategy_name: str, url: str, sync_port: int, out_dir: Path) -> None:
    node_rank = int(os.environ["NODE_RANK"])
    if strategy_name == "ddp":
        module: RolloutCausalLM = RolloutCausalLM(tiny_qwen2(seed=0), lr=1e-2)
        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        module = ShardedCausalLM(tiny_qwen2(seed=0), lr=1e-2)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    sync = VLLMWeightSync(
        engine=url,
        every_n_train_steps=1,
        master_address=os.environ["MASTER_ADDR"],
        master_port=sync_port,
        push_from="every_rank" if strategy_name == "fsdp2" else "rank0",
    )
    engine = HTTPEngine(url)
    version_before = served_version(engine)
    without_key = None
    if node_rank == 0:  # a push with the wrong key is refused before any byte moves
        wrong_key = HTTPEngine(url, api_key="not-the-key")
        try:
            VLLMUpdater(engine=wrong_key, master_address=os.environ["MASTER_ADDR"]).push_weights(tiny_qwen2(seed=41))
            without_key = "pushed"
        except EngineConfigError as error:
            without_key = str(error)
    listeners = RecordsListeners()
    root = out_dir / f"node{node_rank}"
    trainer = cpu_trainer(root, [sync, listeners], max_steps=STEPS, strategy=strategy, num_nodes=2)
    trainer.fit(module, token_batches(num_batches=2 * STEPS))

    rank = trainer.global_rank
    trained = full_model(module) if strategy_name == "fsdp2" else module.model.eval()  # a collective under FSDP2
    result = {
        "global_rank": rank,
        "world_size": trainer.world_size,
        "seen": module.seen,
        "weight_version": sync.weight_version,
        "listening": listeners.listening,
        "weight_version_scalars": [value for _, value in tensorboard_scalars(root, "vllm/weight_version")],
        "event_files": len(list(root.rglob("events.out.tfevents.*"))),
    }
    if rank == 0:
        result["version_before"] = version_before
        result["without_key"] = without_key
        result["served_version"] = int(engine.get_weight_version())
        result["logprob_gap"] = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(trained))
    if strategy_name == "fsdp2":
        ranks = TrainerRanks(timeout_seconds=30)
        result["failed_share"] = failed_share(sync, module, engine, trained, rank, ranks)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if strategy_name == "fsdp2":
        killed_half_way(sync, module, engine, trained, rank, ranks, out_dir)


def killed_half_way(sync, module, engine, trained, rank: int, ranks: TrainerRanks, out_dir: Path) -> None:
    """Last, a push of changed weights whose rank 1 stops itself (SIGSTOP) after its first share; the
    test then kills it (SIGKILL). Rank 0 must fail within its bounds, the server keep its weights.
    Rank 0 writes ``rank0-killed.json`` and leaves at once (torch's teardown would wait for rank 1)."""
    with torch.no_grad():
        for param in module.model.parameters():
            param.to_local().add_(0.01)
    changed = full_model(module)  # what the push would have served (a collective, while both ranks live)
    if rank == 1:
        sends = RankShares.iter_full

        def stops_after_one(shares):
            pieces = sends(shares)
            yield next(pieces)
            os.kill(os.getpid(), signal.SIGSTOP)  # the test kills this process now
            yield from pieces

        RankShares.iter_full = stops_after_one
    outcome = dict(zip(("failure", "failure_seconds"), push_in_shares(sync, module, ranks)))
    served = engine_prompt_logprobs(engine)
    outcome["served"] = int(engine.get_weight_version())
    outcome["gap_to_trained"] = max_abs_diff(served, hf_prompt_logprobs(trained))
    outcome["gap_to_changed"] = max_abs_diff(served, hf_prompt_logprobs(changed))
    (out_dir / "rank0-killed.json").write_text(json.dumps(outcome))
    os._exit(0)


def failed_share(sync: VLLMWeightSync, module, engine: HTTPEngine, trained, rank: int, ranks: TrainerRanks) -> dict:
    """A push in shares whose rank 1 cannot listen (its port is taken), one whose rank 1 fails after its
    first tensor, then one that goes through."""
    outcome: dict = {}
    taken = None
    if rank == 1:
        taken = socket.create_server((send_address(sync.updater.options.address), sync.updater.options.master_port + 1))
    outcome["cannot_listen"], _ = push_in_shares(sync, module, ranks)
    if taken is not None:
        taken.close()
    sends = RankShares.iter_full

    def fails_after_one(shares):
        yield next(sends(shares))
        raise RuntimeError("rank 1 lost its shard")

    if rank == 1:
        RankShares.iter_full = fails_after_one
    outcome["failure"], outcome["failure_seconds"] = push_in_shares(sync, module, ranks)
    RankShares.iter_full = sends
    if rank == 0:
        outcome["served_after_failure"] = int(engine.get_weight_version())
        outcome["gap_after_failure"] = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(trained))
    assert push_in_shares(sync, module, ranks)[0] is None
    outcome["weight_version"] = sync.weight_version
    if rank == 0:
        outcome["served_after_retry"] = int(engine.get_weight_version())
        outcome["gap_after_retry"] = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(trained))
    return outcome


def push_in_shares(sync: VLLMWeightSync, module, ranks: TrainerRanks) -> tuple[str | None, float]:
    """One push with every rank sending its shares: its error (``None`` if it went through) and its seconds."""
    start = time.monotonic()
    try:
        EveryRankShares(ranks).push(sync.updater, module)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return None, time.monotonic() - start


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
