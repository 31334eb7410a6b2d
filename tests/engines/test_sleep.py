"""What the trainer makes of its engines' sleep, without an engine: the workers' reports, the host copy's cost."""

from __future__ import annotations

from lightning_vllm.engines.sleep import SleepState, host_copy_problem


def test_one_state_stands_for_every_workers_report():
    reports = [
        {"asleep": ["kv_cache"], "level": 2, "dropped": 3},
        {"asleep": ["kv_cache", "weights"], "level": 2, "dropped": 3},
    ]
    state = SleepState.of_workers(reports)
    assert state == SleepState(frozenset({"kv_cache", "weights"}), 2, 3)
    assert state.weights_asleep and state.kv_cache_asleep
    assert SleepState.of_workers([]) == SleepState()


def test_a_level_1_copy_the_host_cannot_hold_is_named_with_the_fix():
    problem = host_copy_problem(16 << 30, "in-process vllm.LLM", available_bytes=10 << 30)
    assert problem is not None and "16.0 GiB" in problem and "10.0 GiB available" in problem
    assert "sleep_level=2" in problem
    assert host_copy_problem(16 << 30, "in-process vllm.LLM", available_bytes=16 << 30) is None
    assert host_copy_problem(1, "in-process vllm.LLM") is None  # (this host has a byte to spare)
