"""What the trainer makes of its engines' sleep, without an engine: the workers' reports, the host copy's cost."""

from __future__ import annotations

import pytest

from lightning_vllm.engines.sleep import SleepMode, SleepState, host_copy_problem
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.in_vllm.worker_methods import SLEEP_STATE_METHOD


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


class WorkersWithout(SleepMode):
    """A target whose workers' RPC raises ``error`` (vLLM's answer to a method its workers lack, or a dead engine's)."""

    description = "test engine"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _sleep_mode_enabled(self) -> bool:
        return True

    def _ask_workers(self, method: str) -> list:
        raise self.error

    def sleep(self, level: int, mode: str) -> None:
        raise AssertionError("not asked")

    def wake_up(self, tags=None) -> None:
        raise AssertionError("not asked")


def test_workers_without_the_plugin_are_named_with_the_fix_and_other_errors_pass_through():
    missing = NotImplementedError(f"Method {SLEEP_STATE_METHOD!r} is not implemented.")
    with pytest.raises(EngineConfigError, match="did not load lightning_vllm's vLLM plugin.*Install lightning_vllm"):
        WorkersWithout(missing).sleep_state()
    assert "did not load lightning_vllm's vLLM plugin" in WorkersWithout(missing).sleep_mode_problem()
    with pytest.raises(ConnectionError, match="engine gone"):
        WorkersWithout(ConnectionError("engine gone")).sleep_state()
