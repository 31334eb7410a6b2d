"""A trainer killed at any point of a push leaves ``vllm serve`` serving its last committed
weights and version within its timeout + 10 s (at once, unless it died inside the short
commit window, which the server's ``PauseLease`` ends), and the next trainer connects,
pushes and counts on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    TOLERANCE,
    CallsAtBatch,
    assert_serves,
    cpu_trainer,
    hf_prompt_logprobs,
    max_abs_diff,
    served_logprobs,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
)

from lightning_vllm import HTTPEngine, VLLMUpdater, VLLMWeightSync

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).parents[1] / "stopped_trainer_run.py"
KILLED_TRAINER_TIMEOUT_SECONDS = 5.0  # stopped_trainer_run.TIMEOUT_SECONDS


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


@pytest.mark.parametrize("point", ["after-start", "mid-transfer", "before-commit", "in-commit"])
def test_a_trainer_killed_during_a_push_leaves_the_last_committed_weights(server, point):
    engine = HTTPEngine(server.url)
    committed_model = tiny_qwen2(seed=21)
    first = VLLMUpdater(engine=engine, timeout_seconds=30)
    first.push_weights(committed_model)
    first.close()
    committed_version = engine.get_weight_version()
    committed_model.eval()
    expected = hf_prompt_logprobs(committed_model)  # computed once, outside the timed replies

    def assert_serves_committed_within(seconds: float, since: float) -> None:
        """The server answers with the committed weights and version within ``seconds`` of
        ``since``. Only the server's replies are timed: the Hugging Face reference is not."""
        served = served_logprobs(engine)
        version = engine.get_weight_version()
        elapsed = time.monotonic() - since
        assert max_abs_diff(served, expected) < TOLERANCE
        assert version == committed_version
        assert elapsed < seconds, f"the server took {elapsed:.1f} s to answer"

    # The server's first prompt-logprobs request after a start or a push warms it up (~6 s
    # measured on 2 cores); it is made here, untimed, so that the timed replies below measure
    # whether the stopped or killed trainer holds the server up, and nothing else.
    assert_serves_committed_within(float("inf"), since=time.monotonic())

    trainer = subprocess.Popen(
        [sys.executable, str(SCRIPT), server.url, point, "22"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_line(trainer, "STOPPED", timeout=180)
        if point != "in-commit":  # paused only inside the commit window
            # The trainer sits inside its push: the server still generates, with the old weights.
            assert_serves_committed_within(KILLED_TRAINER_TIMEOUT_SECONDS, since=time.monotonic())
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)

    assert_serves_committed_within(KILLED_TRAINER_TIMEOUT_SECONDS + 10, since=time.monotonic())

    # A new trainer connects, closes the update the killed one left open, and counts on.
    next_model = tiny_qwen2(seed=23)
    second = VLLMUpdater(engine=engine, timeout_seconds=30)
    stats = second.push_weights(next_model)
    second.close()
    assert stats.weight_version == int(committed_version) + 1
    assert engine.get_weight_version() == str(stats.weight_version)
    assert_serves(engine, next_model)


class KillsTheServerMidPush(HTTPEngine):
    """The package's server target; at the push numbered ``kill_at`` it SIGKILLs the whole
    server right after the workers posted their receives."""

    def __init__(self, server, kill_at: int) -> None:
        super().__init__(server.url, api_key=server.api_key)
        self.server, self.kill_at, self.num_updates = server, kill_at, 0

    def update_weights(self, update_info) -> None:
        super().update_weights(update_info)
        self.num_updates += 1
        if self.num_updates == self.kill_at:
            self.server.kill()


def test_with_warn_training_outlives_a_server_killed_mid_push_and_its_restart(server, tmp_path):
    """The shared server is killed, then started again on the same URL (later tests use it as before)."""

    def restart() -> None:
        server.start_again()
        server.wait_until_healthy()

    engine = KillsTheServerMidPush(server, kill_at=2)  # fit start lands, step 1's push meets the kill
    module = CallsAtBatch({2: restart})  # restarts the killed server in training step 3
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, timeout_seconds=20, on_sync_error="warn")
    trainer = cpu_trainer(tmp_path, [sync], max_steps=3)
    with pytest.warns(UserWarning, match="Pushing weights to vLLM failed"):
        trainer.fit(module, token_batches(num_batches=3))

    # Step 1's push failed, step 2's met no server (restarted in step 3), step 3's landed.
    assert tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_failures") == [(1, 1.0), (2, 2.0)]
    assert engine.get_weight_version() == str(sync.weight_version)
    assert_serves(engine, module.hf)
