"""Everything a user does with an in-process ``vllm.LLM`` over vLLM's ``nccl`` backend, on vLLM's own engine on the
one GPU, its engine core an NCCL host of its own (``nccl_hosts.py``): the scenarios of the ``ipc`` tier
(``scenarios.py``), each failure recording what the engine served afterwards and which version it reported, a soak
of 100 pushes over 10 groups that counts what an NCCL communicator holds, and the engine core killed mid-push (last:
it ends the shared engine)."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.gpu


def test_fit_pushes_over_nccl_land_within_the_engines_own_float32_floor(nccl_llm, tmp_path):
    scenarios.fit_lands_with_its_scalars(nccl_llm, tmp_path, prefix="nccl_")


def test_rollouts_in_training_step_carry_the_version_that_produced_them(nccl_llm, tmp_path):
    scenarios.rollouts_carry_their_version(nccl_llm, tmp_path)


def test_background_pushes_land_and_the_last_is_served(nccl_llm, tmp_path):
    scenarios.background_pushes_land(nccl_llm, tmp_path)


def test_changed_only_leaves_a_frozen_embedding_out(nccl_llm, tmp_path):
    scenarios.changed_only_leaves_a_frozen_embedding_out(nccl_llm, tmp_path)


def test_lora_policies_go_merged_and_their_adapter_alone_is_refused_before_a_byte_moves(nccl_llm, tmp_path):
    scenarios.lora_goes_merged_and_its_adapter_alone_is_refused(nccl_llm, tmp_path)


def test_a_hundred_pushes_over_ten_groups_leak_no_memory_communicator_nor_fd(nccl_llm):
    scenarios.a_hundred_pushes_leave_memory_flat(nccl_llm, prefix="nccl_", groups=10, count_leaks=True)


def test_a_push_that_times_out_half_way_fails_in_time_and_the_next_push_lands(nccl_llm):
    scenarios.timing_out_half_way(nccl_llm, timeout=5)


def test_a_source_that_raises_half_way_fails_the_push_and_the_next_push_lands(nccl_llm):
    scenarios.raising_half_way(nccl_llm)


def test_the_engine_core_frozen_mid_push_times_out_and_serves_again_once_continued(nccl_llm):
    scenarios.engine_frozen_half_way(nccl_llm)


@pytest.mark.ends_engine
def test_the_engine_core_killed_mid_push_is_an_error_within_the_timeout(nccl_llm):
    scenarios.engine_killed_half_way(nccl_llm, prefix="nccl_")
