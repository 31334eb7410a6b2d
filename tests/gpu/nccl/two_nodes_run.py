"""One node of a two-node Lightning run on the one GPU, keeping ``vllm serve`` in sync over ``nccl``; started by
``test_nccl_nodes.py`` once per node, each process an NCCL host of its own (``nccl_hosts.py``).

``python two_nodes_run.py STRATEGY SERVER_URL OUT_DIR [cpu]`` with ``STRATEGY`` ``ddp`` or ``fsdp2``, launched the
way users launch Lightning on a cluster, with Lightning's own environment (``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``). Both nodes train on ``cuda:0`` in float32: DDP over the default ``nccl`` process group (on one GPU
only because each rank is its own NCCL host), or FSDP2 (``ModelParallelStrategy``), gathered in lockstep for rank 0
to send (``push_from="rank0"``: ``nccl`` has one sender). Both ranks sample from the server in every step; rank 0
pushes after every step.

After the fit, every rank takes part in pushes of changed weights (``LockstepGathers``): one whose rank 1 fails at
its check-in after its first layer group, one whose rank 0 fails half way through its tensors; each must fail on
both ranks within the bounds of ``TrainerRanks``, and rank 0 records what the server serves after it. Then a push
that goes through. Each rank writes what it saw to ``OUT_DIR/rank<N>.json``.

The trailing ``cpu`` is for debugging this script on a machine without a GPU, against a ``vllm serve`` over
``gloo``: the CPU accelerator and gloo process groups.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]

import gpu_helpers  # noqa: E402
import helpers  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from sharded_run import ShardedCausalLM, failed_fit, full_model  # noqa: E402

import lightning_vllm.fronts.lightning.roles as roles_module  # noqa: E402
from lightning_vllm import HTTPEngine, VLLMWeightSync  # noqa: E402
from lightning_vllm._waits import call_with_timeout  # noqa: E402
from lightning_vllm.fronts.lightning.ranks import TrainerRanks  # noqa: E402
from lightning_vllm.fronts.lightning.roles import LockstepGathers, LockstepWeights  # noqa: E402
from lightning_vllm.weights.base import Weights  # noqa: E402

STEPS = 3
TIMEOUT_SECONDS = 30.0
"""The sync's ``timeout_seconds``: every failure after the fit must reach both ranks within it."""
BUCKET_SIZE_BYTES = 256 << 10
"""Small buckets: the tiny model goes in several broadcasts, so a push that fails half way has some on the wire."""
ANSWER_SECONDS = 30.0
"""The longest the server may take to answer a read of what it serves (a worker left in its receive would hang)."""


def main(strategy_name: str, url: str, out_dir: Path, on_cpu: bool) -> None:
    """Fit on this node, record what the run saw, then the pushes in which a rank fails (module docstring)."""
    node_rank = int(os.environ["NODE_RANK"])
    process_group = "gloo" if on_cpu else "nccl"
    if strategy_name == "ddp":
        module: helpers.RolloutCausalLM = helpers.RolloutCausalLM(helpers.tiny_qwen2(seed=0), lr=1e-2)
        strategy: Any = DDPStrategy(process_group_backend=process_group)
    else:
        module = ShardedCausalLM(helpers.tiny_qwen2(seed=0), lr=1e-2)
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend=process_group
        )
    engine = HTTPEngine(url, timeout_seconds=TIMEOUT_SECONDS, generate_timeout_seconds=ANSWER_SECONDS)
    sync = VLLMWeightSync(
        engine=engine,
        every_n_train_steps=1,
        master_address="127.0.0.1",
        timeout_seconds=TIMEOUT_SECONDS,
        bucket_size_bytes=BUCKET_SIZE_BYTES,
    )
    version_before = bounded(helpers.served_version, engine, what="the server's weight version")
    root = out_dir / f"node{node_rank}"
    make_trainer = helpers.cpu_trainer if on_cpu else gpu_helpers.gpu_trainer
    trainer = make_trainer(root, [sync], max_steps=STEPS, strategy=strategy, devices=1, num_nodes=2)
    trainer.fit(module, helpers.token_batches(num_batches=2 * STEPS))

    rank = trainer.global_rank
    reference = helpers.hf_prompt_logprobs if on_cpu else gpu_helpers.hf_prompt_logprobs
    trained = gathered(module)
    result: dict[str, Any] = {
        "global_rank": rank,
        "world_size": trainer.world_size,
        "seen": module.seen,
        "weight_version": sync.weight_version,
        "weight_version_scalars": [value for _, value in helpers.tensorboard_scalars(root, "vllm/weight_version")],
        "event_files": len(list(root.rglob("events.out.tfevents.*"))),
    }
    if rank == 0:
        result["version_before"] = version_before
        result["served_version"] = bounded(helpers.served_version, engine, what="the server's weight version")
        served = bounded(helpers.engine_prompt_logprobs, engine, what="the server's prompt logprobs")
        result["logprob_gap"] = helpers.max_abs_diff(served, reference(trained))
    ranks = TrainerRanks(timeout_seconds=TIMEOUT_SECONDS)
    result["rank_failures"] = rank_failures(sync, module, engine, trained, ranks, reference)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    ranks.close()
    torch.distributed.destroy_process_group()


def gathered(module: helpers.RolloutCausalLM) -> torch.nn.Module:
    """The module's weights as a plain model of its own (a collective under FSDP2: every rank calls it)."""
    return full_model(module) if isinstance(module, ShardedCausalLM) else copy.deepcopy(module.model).eval()


def bounded(read: Callable[..., Any], *args: Any, what: str) -> Any:
    """``read(*args)``, failing after :data:`ANSWER_SECONDS` instead of hanging (a server left blocked)."""
    return call_with_timeout(read, *args, timeout=ANSWER_SECONDS, what=what)


def rank_failures(
    sync: VLLMWeightSync,
    module: helpers.RolloutCausalLM,
    engine: HTTPEngine,
    trained: torch.nn.Module,
    ranks: TrainerRanks,
    reference: Callable[[torch.nn.Module], list[list[float]]],
) -> dict[str, Any]:
    """Pushes of changed weights, every rank walking them: rank 1 fails, then rank 0 fails, then one goes through.

    Each failure's error and seconds are recorded on every rank; rank 0 adds what the server serves after it
    (``gpu_helpers.what_it_serves``: the trained weights, the changed ones, or a mix, and its version).
    """
    with torch.no_grad():  # as an optimizer step would, alike on every rank
        for parameter in module.model.parameters():
            (parameter.to_local() if isinstance(parameter, DTensor) else parameter).add_(0.01)
    changed = gathered(module)
    outcome: dict[str, Any] = {}
    for failing_rank, failure in ((1, FailsAfterFirstGroup), (0, FailsHalfWay)):
        with walking_with(failure if ranks.rank == failing_rank else LockstepWeights):
            failed = failed_fit(lambda: LockstepGathers(ranks).push(sync.updater, module))
        if ranks.rank == 0:
            failed["served"] = gpu_helpers.what_it_serves(engine, trained, changed, reference, ANSWER_SECONDS)
        outcome[f"rank{failing_rank}_fails"] = failed
    outcome["next_push"] = failed_fit(lambda: LockstepGathers(ranks).push(sync.updater, module))
    outcome["weight_version"] = sync.weight_version
    if ranks.rank == 0:
        outcome["next_push"]["served"] = gpu_helpers.what_it_serves(engine, trained, changed, reference, ANSWER_SECONDS)
    return outcome


@contextmanager
def walking_with(lockstep: type[LockstepWeights]) -> Iterator[None]:
    """Inside, this rank's pushes in lockstep walk their weights with ``lockstep`` (``LockstepGathers`` builds one
    per push)."""
    original = roles_module.LockstepWeights
    roles_module.LockstepWeights = lockstep  # type: ignore[misc]
    try:
        yield
    finally:
        roles_module.LockstepWeights = original  # type: ignore[misc]


class FailsAfterFirstGroup(LockstepWeights):
    """A rank that fails once it has gathered its first layer group: at its next check-in, where a rank's own
    failure is reported (``LockstepWeights.fail``), outside any gather, so no peer is left waiting in one."""

    FAILING_CHECK_IN = 3
    """Its check-ins: 1, it has its weights; 2, before the first group; 3, before the second."""

    def __init__(self, source: Weights, ranks: TrainerRanks) -> None:
        super().__init__(source, ranks)
        self.num_check_ins = 0

    def check_in(self, status: int, version: int = 0) -> tuple[int, int]:
        self.num_check_ins += 1
        if self.num_check_ins == self.FAILING_CHECK_IN:
            raise RuntimeError(f"rank {self.ranks.rank} lost its weights after one layer group")
        return super().check_in(status, version)


class FailsHalfWay(LockstepWeights):
    """A rank whose read of its middle tensor raises (after gathering it), once: rank 0 then fails in the middle
    of its transfer, and still finishes the gathers of the group under way with its peers (``LockstepWeights.fail``)."""

    def __init__(self, source: Weights, ranks: TrainerRanks) -> None:
        super().__init__(RaisesOnceHalfWay(source), ranks)


class RaisesOnceHalfWay(Weights):
    """``source``'s tensors, whose middle one is read and then raises instead of being yielded; the reading goes
    on after it (a generator would end with its error, and the peers would wait in the gathers left)."""

    def __init__(self, source: Weights) -> None:
        self.source = source

    def declare(self) -> list[Any]:
        return list(self.source.metadata)

    def groups(self) -> list[list[str]]:
        return self.source.groups()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return _RaisingOnce(self.source.iter_full(), at=len(self.metadata) // 2)


class _RaisingOnce:
    """An iterator over ``items`` whose ``at``-th step reads its item, drops it and raises."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], at: int) -> None:
        self.items, self.at, self.position = items, at, 0

    def __iter__(self) -> _RaisingOnce:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        item = next(self.items)
        self.position += 1
        if self.position == self.at + 1:
            raise RuntimeError(f"rank 0 could not read {item[0]} half way through its push")
        return item


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), on_cpu=sys.argv[4:] == ["cpu"])
