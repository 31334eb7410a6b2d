"""The other engines a user pushes to over ``nccl``, each engine core an NCCL host of its own on the one GPU: an
``AsyncLLM`` in each pause mode, two engines at once (two replicas, each in its own group), a bf16 model of 1.5B
parameters, and a tiny Mixture-of-Experts policy trained by ``Trainer.fit``."""

from __future__ import annotations

from functools import partial

import pytest
import scenarios
from gpu_helpers import (
    FIGURES,
    fit_lands_within_the_floor,
    gpu_trainer,
    hf_prompt_logprobs,
    moe_llm_over,
    moe_policy,
    stop_llm,
)
from helpers import TinyCausalLM, max_abs_diff, served_logprobs, tiny_qwen2, token_batches
from nccl_hosts import starting_as

from lightning_vllm import VLLMWeightSync
from lightning_vllm.engines.base import version_number

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_a_push_in_each_pause_mode_lands_beside_a_request_in_flight(nccl_async_engine, mode):
    scenarios.push_beside_a_request_in_flight(nccl_async_engine, mode, prefix="nccl_")


def test_fit_keeps_two_replicas_in_sync_each_in_a_group_of_its_own(nccl_llm, nccl_async_engine, tmp_path):
    engines = [nccl_llm, nccl_async_engine]
    starts = [version_number(engine.get_weight_version()) for engine in engines]
    module = TinyCausalLM(tiny_qwen2(seed=21), lr=1e-2)
    sync = VLLMWeightSync(engine=engines, every_n_train_steps=1)

    gpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))

    gaps = [max_abs_diff(served_logprobs(engine), hf_prompt_logprobs(module.hf)) for engine in engines]
    FIGURES.update(nccl_replica_gaps=gaps)
    assert all(gap <= scenarios.FLOOR_BOUND for gap in gaps), gaps
    # Every push reaches both (fit start, steps 1 and 2), going on from the larger version either served.
    assert sync.updater.engine_versions() == {0: str(max(starts) + 3), 1: str(max(starts) + 3)}
    assert [engine.get_weight_version() for engine in engines] == [str(sync.weight_version)] * 2


def test_every_push_of_a_1_5b_bf16_model_lands_exactly(tmp_path):
    # (only the engine's start: this process must stay the trainer's NCCL host when it joins the engine's group)
    starting = partial(starting_as, "engine-bf16")
    scenarios.every_bf16_push_lands_exactly(tmp_path, backend="nccl", prefix="nccl_", starting=starting)


def test_fit_pushes_of_a_moe_policy_land_within_the_engines_own_float32_floor(tmp_path_factory, tmp_path):
    with starting_as("engine-moe"):
        llm = moe_llm_over("nccl", tmp_path_factory.mktemp("tiny-moe-nccl"))
    try:
        fit_lands_within_the_floor(llm, tmp_path, figures_prefix="moe_nccl_", model=moe_policy())
    finally:
        stop_llm(llm)
