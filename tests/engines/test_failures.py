"""A trainer killed at any point of a push leaves ``vllm serve`` serving its last committed
weights and version, never frozen, and the next trainer connects, pushes and counts on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_serves, tiny_qwen2

from lightning_vllm import HTTPEngine, VLLMUpdater

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).parents[1] / "stopped_trainer_run.py"
KILLED_TRAINER_TIMEOUT_SECONDS = 10.0  # stopped_trainer_run.TIMEOUT_SECONDS


def wait_for_line(process: subprocess.Popen, expected: str, timeout: float) -> None:
    """Read the process's output until ``expected`` (bounded in time and lines)."""
    deadline = time.monotonic() + timeout
    for _ in range(10_000):
        assert time.monotonic() < deadline, f"no {expected!r} from the trainer within {timeout} s"
        line = process.stdout.readline()
        assert line, f"the trainer exited ({process.wait(timeout=10)}) before printing {expected!r}"
        assert line.strip() != "PUSHED", "the trainer was meant to stop before its push ended"
        if line.strip() == expected:
            return
    raise AssertionError(f"no {expected!r} in 10000 lines")


@pytest.mark.parametrize("point", ["after-start", "mid-transfer", "before-commit"])
def test_a_trainer_killed_during_a_push_leaves_the_last_committed_weights(server, point):
    engine = HTTPEngine(server.url)
    committed_model = tiny_qwen2(seed=21)
    first = VLLMUpdater(engine=engine, timeout_seconds=30)
    first.push_weights(committed_model)
    first.close()
    committed_version = engine.get_weight_version()

    trainer = subprocess.Popen(
        [sys.executable, str(SCRIPT), server.url, point, "22"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_line(trainer, "STOPPED", timeout=180)
        # The trainer sits inside its push: the server still generates, with the old weights.
        started = time.monotonic()
        assert_serves(engine, committed_model)
        assert engine.get_weight_version() == committed_version
        assert time.monotonic() - started < KILLED_TRAINER_TIMEOUT_SECONDS
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)

    killed = time.monotonic()
    assert_serves(engine, committed_model)
    assert engine.get_weight_version() == committed_version
    assert time.monotonic() - killed < KILLED_TRAINER_TIMEOUT_SECONDS + 10

    # A new trainer connects, closes the update the killed one left open, and counts on.
    next_model = tiny_qwen2(seed=23)
    second = VLLMUpdater(engine=engine, timeout_seconds=30)
    stats = second.push_weights(next_model)
    second.close()
    assert stats.weight_version == int(committed_version) + 1
    assert engine.get_weight_version() == str(stats.weight_version)
    assert_serves(engine, next_model)
