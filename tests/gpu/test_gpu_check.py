"""The check after every push, and pushes that load with one copy (``lightning_ipc``), on vLLM's own engine
on one GPU: what lands is what was sent, and a layer corrupted inside the engine is named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    changed_after_loading,
    digests_equal,
    engine_digest,
    hf_greedy,
    hf_prompt_logprobs,
    model_digest,
    pushes_sum_what_they_write,
    records_forgotten,
    replay_one_row_off,
    trainer_engine,
    written_and_read,
)
from helpers import max_abs_diff, tiny_qwen2, vllm_greedy, vllm_prompt_logprobs

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import LandedWeightsMismatchError

pytestmark = pytest.mark.gpu

MLP = "model.layers.1.mlp"


def add_to_parameter(llm: Any, name: str, amount: float) -> None:
    """Add ``amount`` to the first element of vLLM's parameter ``name`` inside its worker (a faulty load)."""

    def corrupt(worker: Any) -> None:  # runs in vLLM's worker (cloudpickled: defined here)
        import torch

        parameter = dict(worker.get_model().named_parameters())[name]
        with torch.no_grad():
            parameter.view(-1)[0] += amount

    llm.collective_rpc(corrupt)


def test_pushes_into_lightning_ipc_land_exactly_and_are_checked(lightning_ipc_llm):
    floor = max_abs_diff(vllm_prompt_logprobs(lightning_ipc_llm), hf_prompt_logprobs(tiny_qwen2(seed=0).cuda()))
    model = tiny_qwen2(seed=51).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120, verify_pushes=True)
    for step in range(3):
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.add_(0.01 * (step + 1))
        stats = updater.push_weights(model)
        assert stats.timing.check_seconds > 0
        assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model))
    gap = max_abs_diff(vllm_prompt_logprobs(lightning_ipc_llm), hf_prompt_logprobs(model))
    FIGURES.update(lightning_ipc_floor=floor, lightning_ipc_gap_after_sync=gap)
    assert gap <= 2 * max(floor, 2.0e-4), (gap, floor)
    assert vllm_greedy(lightning_ipc_llm) == hf_greedy(model)
    assert lightning_ipc_llm.get_weight_version() == str(updater.weight_version)
    # The worker left its sums in the trainer's tensor as the push landed (sums_mailbox.py): nothing was asked.
    assert trainer_engine(updater).sums_expected
    updater.close()


def test_a_layer_corrupted_in_the_engine_is_named_and_the_next_push_mends_it(lightning_ipc_llm):
    model = tiny_qwen2(seed=52).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120, verify_pushes=True)
    updater.push_weights(model)
    add_to_parameter(lightning_ipc_llm, f"{MLP}.down_proj.weight", 0.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)  # a changed-only push of another layer
    with pytest.raises(LandedWeightsMismatchError, match=rf"1 layer\(s\), {MLP}\b") as caught:
        updater.push_weights(model)
    assert caught.value.layers == {0: [MLP]}
    updater.push_weights(model)  # every tensor again
    assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model))
    updater.close()


def test_lightning_ipc_sums_what_its_copies_write_and_reads_no_weight_again(lightning_ipc_llm):
    model = tiny_qwen2(seed=54).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120, changed_only=False)
    records_forgotten(lightning_ipc_llm)
    updater.push_weights(model)  # through vLLM's loaders, recorded (nothing summed: read after the commit)
    assert written_and_read(lightning_ipc_llm)[0] == []
    # The recorded copies bound to the trainer's tensors, then the kept replay run again.
    pushes_sum_what_they_write(lightning_ipc_llm, model, updater)
    updater.close()


@pytest.mark.parametrize(
    ("fault", "changed"),
    [
        # gate's rows one further into vLLM's fused gate_up_proj: into up's first row, gate's first left stale
        (lambda llm: replay_one_row_off(llm, "model.layers.0.mlp.gate_proj.weight"), "model.layers.0.mlp.gate_proj"),
        # a load that leaves a value other than sent, after the loaders' copy (no record: loaded through them)
        (lambda llm: changed_after_loading(llm, f"{MLP}.down_proj.weight"), f"{MLP}.down_proj"),
    ],
    ids=["replay_one_row_off", "value_changed_after_the_copy"],
)
def test_lightning_ipc_a_fault_in_the_load_is_named_at_that_push_and_the_loaders_mend_it(
    lightning_ipc_llm, fault, changed
):
    model = tiny_qwen2(seed=55).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120)
    updater.push_weights(model)
    fault(lightning_ipc_llm)
    with torch.no_grad():
        model.get_submodule(changed).weight.add_(0.01)
    layer = changed.rpartition(".")[0]
    with pytest.raises(LandedWeightsMismatchError, match=rf"1 layer\(s\), {layer}\b"):
        updater.push_weights(model)
    records_forgotten(lightning_ipc_llm)
    updater.push_weights(model)
    assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model))
    updater.push_weights(tiny_qwen2(seed=0).cuda())  # the shared engine serves what it started from again
    updater.close()


def test_vllms_own_ipc_engine_is_checked_with_no_worker_extension(ipc_llm):
    model = tiny_qwen2(seed=53).cuda()
    updater = VLLMUpdater(engine=ipc_llm, timeout_seconds=120, verify_pushes=True)
    updater.push_weights(model)
    add_to_parameter(ipc_llm, "model.norm.weight", 0.25)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)
    with pytest.raises(LandedWeightsMismatchError, match=r"model\.norm\b"):
        updater.push_weights(model)
    assert updater.push_weights(model).timing.check_seconds > 0
    assert digests_equal(engine_digest(ipc_llm), model_digest(model))
    updater.push_weights(tiny_qwen2(seed=0).cuda())  # the shared engine serves what it started from again
    updater.close()
