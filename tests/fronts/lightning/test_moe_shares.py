"""Each trainer rank's share of a Mixture-of-Experts policy in its checkpoint's layout (``weights/shares.py``): a
checkpoint tensor cut out of a fused one is sent by the ranks holding its run of bytes. Here on a model every rank
holds whole; FSDP2's shards by expert are sent into a real engine in test_ranks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import NUM_EXPERTS, tiny_moe

from lightning_vllm.weights.checkpoint_layout import CheckpointWeights
from lightning_vllm.weights.shares import RankShares, tensor_runs
from lightning_vllm.weights.sources import ModuleWeights, weights_from


@pytest.fixture(scope="module")
def moe() -> torch.nn.Module:
    return tiny_moe("qwen3_moe", seed=0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_shares_of_each_checkpoint_tensor_laid_end_to_end_are_that_tensor(moe, world_size):
    source = weights_from(moe)
    assert isinstance(source, CheckpointWeights)
    per_rank = [RankShares.of(source, rank, world_size) for rank in range(world_size)]
    assert all(isinstance(shares, RankShares) for shares in per_rank)
    pieces = [dict(shares.iter_full()) for shares in per_rank]
    full = dict(source.iter_full())
    assert list(pieces[0]) == list(full) == [meta.name for meta in source.metadata]
    for name, tensor in full.items():
        assert torch.equal(torch.cat([rank_pieces[name] for rank_pieces in pieces]), tensor.reshape(-1)), name
        assert [piece[name].numel() for piece in pieces] == per_rank[0].counts(name)
    assert per_rank[0].metadata == source.metadata  # the engine checks the checkpoint's tensors


def test_an_expert_is_a_run_of_its_fused_tensor_and_its_pieces_are_views(moe):
    source = weights_from(moe)
    fused = moe.model.layers[1].mlp.experts.gate_up_proj
    runs = {name: (tensor, begin, length) for name, tensor, begin, length in tensor_runs(source)}
    per_expert = fused[0].numel()  # [2 * intermediate, hidden]
    for expert in range(NUM_EXPERTS):
        gate = runs[f"model.layers.1.mlp.experts.{expert}.gate_proj.weight"]
        up = runs[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"]
        assert gate == (fused, expert * per_expert, per_expert // 2)
        assert up == (fused, expert * per_expert + per_expert // 2, per_expert // 2)
    # Two ranks holding the whole model split the fused tensor's bytes in halves: experts 0 and 1, then 2 and 3.
    shares = [dict(RankShares(source, rank, 2).iter_full()) for rank in (0, 1)]
    expert_2 = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert shares[0][expert_2].numel() == 0 and shares[1][expert_2].numel() == per_expert // 2
    assert shares[1][expert_2].data_ptr() == fused.data_ptr() + 4 * (2 * per_expert + per_expert // 2)  # no copy


def test_a_checkpoint_tensor_the_conversion_computes_is_gathered_instead():
    linear = torch.nn.Linear(3, 2)
    model = ModuleWeights(linear)

    def transposed(tensors):  # a conversion whose output is no run of its input's bytes
        for name, tensor in tensors:
            yield name, tensor.t() if name == "weight" else tensor

    plan = SimpleNamespace(convert=transposed, metadata=model.metadata, groups=[["weight", "bias"]])
    reason = RankShares.of(CheckpointWeights(model, plan), 0, 2)
    assert reason == (
        "'weight' is not one run of a tensor in memory: transformers' conversion into the checkpoint's layout "
        "computes it"
    )


def test_a_lora_merged_moe_is_gathered_instead():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_moe("qwen3_moe", seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    reason = RankShares.of(weights_from(policy), 0, 2)
    assert reason == "a LoraMergedWeights is not sent in shares (only a plain or FSDP2 model is)"
