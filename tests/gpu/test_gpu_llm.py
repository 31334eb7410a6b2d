"""Everything a user does with an in-process ``vllm.LLM`` on one GPU over vLLM's ipc backend, on vLLM's own
engine (``scenarios.py``): ``Trainer.fit`` with ``VLLMWeightSync``, rollouts during training, background and
changed-only pushes, LoRA, a push that fails or times out half way, 100 pushes, and the engine core killed mid-push
(last: it ends the shared engine)."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.gpu


def test_fit_pushes_land_within_the_engines_own_float32_floor(ipc_llm, tmp_path):
    scenarios.fit_lands_with_its_scalars(ipc_llm, tmp_path)


def test_rollouts_in_training_step_carry_the_version_that_produced_them(ipc_llm, tmp_path):
    scenarios.rollouts_carry_their_version(ipc_llm, tmp_path)


def test_background_pushes_land_and_the_last_is_served(ipc_llm, tmp_path):
    scenarios.background_pushes_land(ipc_llm, tmp_path)


def test_changed_only_leaves_a_frozen_embedding_out(ipc_llm, tmp_path):
    scenarios.changed_only_leaves_a_frozen_embedding_out(ipc_llm, tmp_path)


def test_lora_policies_go_merged_over_ipc_and_their_adapter_alone_is_refused_before_a_byte_moves(ipc_llm, tmp_path):
    scenarios.lora_goes_merged_and_its_adapter_alone_is_refused(ipc_llm, tmp_path)


def test_a_push_that_fails_half_way_leaves_the_engine_serving_and_the_next_push_lands(ipc_llm):
    scenarios.raising_half_way(ipc_llm, timeout=60)


def test_a_push_that_times_out_half_way_leaves_the_engine_serving_and_the_next_push_lands(ipc_llm):
    scenarios.timing_out_half_way(ipc_llm, timeout=5)


def test_a_hundred_pushes_leave_gpu_memory_flat_on_both_sides(ipc_llm):
    scenarios.a_hundred_pushes_leave_memory_flat(ipc_llm)


def test_the_engine_core_killed_mid_push_is_an_error_within_the_timeout(ipc_llm):
    scenarios.engine_killed_half_way(ipc_llm)
