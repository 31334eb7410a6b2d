"""Two CPU processes push a sharded Mixture-of-Experts policy (a tiny Qwen3-MoE) into a vLLM engine on rank 0;
started by test_ranks.py.

transformers 5 holds the experts fused (``mlp.experts.gate_up_proj``, ``[experts, 2 * intermediate, hidden]``),
vLLM loads them one by one, and FSDP2 shards the fused tensors by expert. One engine, four runs in a row:
  1. FSDP2 through Lightning's ModelParallelStrategy, rank 0 sending (gathered layer group by layer group);
  2. the same with ``push_from="every_rank"``: each rank sends the experts it holds, nothing gathered;
  3. FSDP1 and DeepSpeed ZeRO-3 driven by hand (``sharded_run.by_hand_run``), rank 0 sending;
  4. ZeRO-3 with ``push_from="every_rank"``: it has no share per rank, so it is gathered, with a warning.
Each rank writes what it saw to rank<N>.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/: the helpers and sharded_run
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

import torch  # noqa: E402
from helpers import (  # noqa: E402
    build_llm,
    hf_prompt_logprobs,
    max_abs_diff,
    shutdown,
    tiny_moe,
    token_batches,
    vllm_prompt_logprobs,
)
from sharded_run import ZERO3_CONFIG, ShardedCausalLM, by_hand_run, full_model, trainer_for  # noqa: E402

import lightning_vllm.core.landing_check as landing_check  # noqa: E402
import lightning_vllm.fronts.lightning.every_rank as every_rank  # noqa: E402
import lightning_vllm.fronts.lightning.roles as roles  # noqa: E402
from lightning_vllm import VLLMUpdater, VLLMWeightSync  # noqa: E402
from lightning_vllm.backends.gloo.shares import GlooShareSender  # noqa: E402
from lightning_vllm.fronts.lightning.ranks import TrainerRanks  # noqa: E402
from lightning_vllm.weights.shares import RankShares  # noqa: E402
from lightning_vllm.weights.sources import weights_from  # noqa: E402

EXPERTS = "model.layers.0.mlp.experts.{}.{}.weight"


def tiny_qwen3_moe(seed: int = 0) -> torch.nn.Module:
    """The policy of every run here (``sharded_run``'s builders take a ``seed``)."""
    return tiny_moe("qwen3_moe", seed=seed)


class Heard(logging.Handler):
    """The warnings of the every-rank roles (it says when a push is gathered instead) and of the check after every
    push (it says what it cannot check), while in a ``with``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def __enter__(self) -> Heard:
        for name in (every_rank.__name__, roles.__name__, landing_check.__name__):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in (every_rank.__name__, roles.__name__, landing_check.__name__):
            logging.getLogger(name).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def sent_by_this_rank() -> list[int]:
    """The bytes of each share this rank (other than 0) sends from now on."""
    sent: list[int] = []
    send_pass = GlooShareSender.send_pass

    def counted(self, *args, **kwargs) -> int:
        sent.append(send_pass(self, *args, **kwargs))
        return sent[-1]

    GlooShareSender.send_pass = counted  # type: ignore[method-assign]
    return sent


def fsdp2_run(out_dir: Path, llm, rank: int, push_from: str, seed: int) -> dict:
    """A fit of 2 steps pushing at fit start and after each step; what vLLM serves then, against the trained
    weights gathered into a plain model."""
    module = ShardedCausalLM(tiny_qwen3_moe(seed), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1, timeout_seconds=30, push_from=push_from)
    trainer_for(out_dir / push_from, sync, max_steps=2).fit(module, token_batches(num_batches=4))
    trained = full_model(module, build=tiny_qwen3_moe)  # a collective
    result: dict = {"weight_version": sync.weight_version, "rollouts": len(module.seen)}
    if rank == 0:
        result["max_logprob_diff"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(trained))
        result["engine_version"] = llm.get_weight_version()
        result["num_bytes"] = sync.updater.last_sync.num_bytes
        result["check_seconds"] = sync.updater.last_sync.timing.check_seconds  # (the check after the push ran)
        result["full_bytes"] = sum(param.numel() * 4 for param in trained.parameters())
        # What each rank sends of expert 1 and expert 2 of the first layer: the rank holding it sends it whole.
        shares = RankShares.of(weights_from(module.model), rank, 2)
        assert isinstance(shares, RankShares), shares
        result["expert_counts"] = {
            f"{expert}.{projection}": shares.counts(EXPERTS.format(expert, projection))
            for expert in (1, 2)
            for projection in ("gate_proj", "up_proj", "down_proj")
        }
    return result


def zero3_every_rank(llm, rank: int) -> dict:
    """A ZeRO-3 MoE pushed with every rank sending: ZeRO-3 partitions are no share of a tensor, so it is gathered
    and rank 0 sends it, with a warning that says why."""
    import deepspeed

    reference, model = tiny_qwen3_moe(seed=10), tiny_qwen3_moe(seed=10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3_CONFIG)
    ranks = TrainerRanks(timeout_seconds=30)
    updater = VLLMUpdater(engine=llm, timeout_seconds=30)
    with Heard() as heard:
        roles.EveryRankShares(ranks).push(updater.weight_sync, engine)
    result: dict = {"warnings": heard.messages, "weight_version": updater.weight_version}
    if rank == 0:
        result["max_logprob_diff"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(reference))
    updater.close()
    ranks.close()
    return result


def run(model_dir: Path, out_dir: Path) -> None:
    # Lightning's launcher starts rank 1 by running this script again with LOCAL_RANK=1.
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    llm = build_llm(model_dir) if rank == 0 else None
    result: dict = {"rank": rank, "rank0": fsdp2_run(out_dir, llm, rank, "rank0", seed=1)}
    sent = sent_by_this_rank()
    with Heard() as heard:
        result["every_rank"] = {**fsdp2_run(out_dir, llm, rank, "every_rank", seed=2), "warnings": heard.messages}
    result["every_rank"]["sent"] = sent
    result["by_hand"] = by_hand_run(llm, rank, build=tiny_qwen3_moe)
    result["zero3_every_rank"] = zero3_every_rank(llm, rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if llm is not None:
        shutdown(llm)


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
