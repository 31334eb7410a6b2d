"""The plugin's cap on vLLM's busy-wait, applied in this process (no engine)."""

from __future__ import annotations

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from lightning_vllm.in_vllm.busy_wait import BUSY_LOOP_VARIABLE, busy_loop_limit, limit_busy_wait


@pytest.fixture
def original_wait():
    wait = shm_broadcast.SpinCondition.wait
    yield getattr(wait, "__wrapped__", wait)
    shm_broadcast.SpinCondition.wait = wait


def test_without_the_variable_vllm_keeps_its_own_spin(monkeypatch, original_wait):
    monkeypatch.delenv(BUSY_LOOP_VARIABLE, raising=False)
    assert limit_busy_wait() is None and busy_loop_limit() is None


def test_the_variable_caps_every_reader_and_a_second_call_replaces_the_cap(monkeypatch, original_wait):
    calls = []

    class Reader:
        busy_loop_s = 1.0

    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", lambda self, timeout_ms=None: calls.append(timeout_ms))
    monkeypatch.setenv(BUSY_LOOP_VARIABLE, "0.002")
    assert limit_busy_wait() == 0.002
    reader = Reader()
    shm_broadcast.SpinCondition.wait(reader, 5)  # type: ignore[arg-type]
    assert reader.busy_loop_s == 0.002 and calls == [5]
    monkeypatch.setenv(BUSY_LOOP_VARIABLE, "0")
    limit_busy_wait()
    shm_broadcast.SpinCondition.wait(reader, None)  # type: ignore[arg-type]
    assert reader.busy_loop_s == 0 and calls == [5, None]  # wrapped once, not twice


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_value_is_named(monkeypatch, value):
    monkeypatch.setenv(BUSY_LOOP_VARIABLE, value)
    with pytest.raises(ValueError, match=f"{BUSY_LOOP_VARIABLE}='{value}'"):
        busy_loop_limit()
