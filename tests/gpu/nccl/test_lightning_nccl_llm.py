"""Everything a user does with an in-process ``vllm.LLM`` over ``lightning_nccl`` (vLLM's NCCL protocol into workers
that stage a push and commit it whole), on vLLM's own engine on the one GPU, its engine core an NCCL host of its own:
the scenarios of the other tiers (``scenarios.InProcessEngineScenarios``), where every failed push must leave the
engine serving the last committed weights, digest-equal, under their version (issue 46); the staging room's memory
and what a staged push costs against ``nccl``'s streaming one, on the same engine size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_helpers import FIGURES, digests_equal, engine_digest, model_digest, pushes_sum_what_they_write
from helpers import tiny_qwen2
from scenarios import InProcessEngineScenarios

from lightning_vllm import VLLMUpdater

pytestmark = pytest.mark.gpu


class TestInProcessLLMOverLightningNCCL(InProcessEngineScenarios):
    prefix = "lightning_nccl_"
    atomic = True

    @pytest.fixture
    def llm(self, lightning_nccl_llm: Any) -> Any:
        return lightning_nccl_llm


def test_the_staging_room_is_one_copy_of_the_weights_and_each_push_lands_digest_equal(lightning_nccl_llm):
    model = tiny_qwen2(seed=71).cuda()
    updater = VLLMUpdater(engine=lightning_nccl_llm, timeout_seconds=60, changed_only=False)
    updater.push_weights(model)

    def room(worker: Any) -> tuple[int, int, int, int]:  # runs in vLLM's worker
        engine = worker.weight_transfer_engine
        weights = sum(p.numel() * p.element_size() for p in worker.get_model().parameters())
        return engine.room.nbytes, weights, engine.loads.replayed, engine.room.allocations

    ((_, _, replayed_before, allocations_before),) = lightning_nccl_llm.collective_rpc(room)
    for step in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * (step + 1))
        updater.push_weights(model)
        assert digests_equal(engine_digest(lightning_nccl_llm), model_digest(model)), step
    assert lightning_nccl_llm.get_weight_version() == str(updater.weight_version)

    ((room_bytes, weight_bytes, replayed, allocations),) = lightning_nccl_llm.collective_rpc(room)
    FIGURES["lightning_nccl_room"] = {
        "room_bytes": room_bytes,
        "weight_bytes": weight_bytes,
        "atomic_memory_over_model": room_bytes / weight_bytes,
        "replayed_commits": replayed - replayed_before,
    }
    print(f"atomic_memory_over_model={room_bytes / weight_bytes:.3f}")
    assert replayed - replayed_before == 3  # each commit replays the copies recorded from the room
    assert allocations == allocations_before  # the room is kept, not remade
    assert room_bytes <= weight_bytes * 1.01  # one copy of the weights (the HF layout: q/k/v apart, same bytes)
    updater.close()


def test_the_commit_sums_what_it_copies_from_the_room_and_reads_no_weight_again(lightning_nccl_llm):
    model = tiny_qwen2(seed=72).cuda()
    updater = VLLMUpdater(engine=lightning_nccl_llm, timeout_seconds=60, changed_only=False)
    updater.push_weights(model)  # (the room's copies recorded, if an earlier test has not)
    pushes_sum_what_they_write(lightning_nccl_llm, model, updater)
    updater.close()
