"""Each trainer rank's share of a tensor (``weights/shares.py``), on tensors every rank holds whole;
FSDP2's DTensor shards are sent in shares across two hosts in tests/engines/test_multihost.py."""

from __future__ import annotations

import pytest
import torch

from lightning_vllm.weights.layer_sums import SQUARES_MODULUS, tensor_sums
from lightning_vllm.weights.shares import RankShares, chunk_counts, local_share, share_counts
from lightning_vllm.weights.sources import MappingWeights, ModuleWeights


@pytest.mark.parametrize(
    ("length", "world_size", "counts"),
    [(10, 4, [3, 3, 3, 1]), (2, 4, [1, 1, 0, 0]), (0, 3, [0, 0, 0]), (7, 1, [7]), (6, 2, [3, 3])],
)
def test_counts_follow_torch_chunk(length, world_size, counts):
    assert chunk_counts(length, world_size) == counts
    expected = [len(chunk) for chunk in torch.arange(length).chunk(world_size)] if length else []
    assert counts[: len(expected)] == expected and sum(counts) == length


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_shares_of_a_whole_tensor_laid_end_to_end_are_the_tensor(world_size):
    tensor = torch.randn(5, 3)
    counts = share_counts(tensor, world_size)
    shares = [local_share(tensor, rank, counts) for rank in range(world_size)]
    assert torch.equal(torch.cat(shares), tensor.reshape(-1))
    assert all(share.data_ptr() == tensor.data_ptr() + 4 * sum(counts[:rank]) for rank, share in enumerate(shares))


def test_every_rank_reads_its_own_shares_in_the_sources_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    source = ModuleWeights(model)
    per_rank = [dict(RankShares(source, rank, 2).iter_full()) for rank in (0, 1)]
    assert list(per_rank[0]) == [meta.name for meta in source.metadata]
    for name, tensor in source.iter_full():
        assert torch.equal(torch.cat([per_rank[0][name], per_rank[1][name]]), tensor.reshape(-1))
    assert RankShares(source, 0, 2).metadata == source.metadata  # the engine checks the full tensors


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_the_ranks_shares_fingerprints_add_up_to_the_tensors(wire):
    # The check after a push every rank sends a share of: rank 0 adds the other ranks' fingerprints to its own.
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    source = ModuleWeights(model)
    sent = [(meta.name, wire) for meta in source.metadata][1:]  # (a pass may carry some of the tensors)
    per_rank = [RankShares(source, rank, 2).sums(sent) for rank in (0, 1)]
    full = {name: tensor_sums(tensor, wire).tolist() for name, tensor in source.iter_full()}
    assert set(per_rank[0]) == set(per_rank[1]) == {name for name, _ in sent}
    for name, _ in sent:
        bits, squares, not_finite = (sum(sums[name][position] for sums in per_rank) for position in range(3))
        assert bits == full[name][0] and not_finite == full[name][2] == 0
        assert (squares - full[name][1]) % SQUARES_MODULUS == 0


def test_only_a_plain_or_fsdp2_model_is_sent_in_shares():
    assert isinstance(RankShares.of(ModuleWeights(torch.nn.Linear(2, 2)), 0, 2), RankShares)
    reason = RankShares.of(MappingWeights({"w": torch.ones(2)}), 0, 2)
    assert reason == "a MappingWeights is not sent in shares (only a plain or FSDP2 model is)"
