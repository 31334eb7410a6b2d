"""examples/grpo_tiny.py end to end, from its LightningCLI YAML and on two FSDP2 processes with a LoRA policy.

Both runs start beside the other examples' (``conftest.py``); each test waits for its own.
"""

from __future__ import annotations

import pytest
from helpers import EXAMPLES, tensorboard_scalars

pytestmark = pytest.mark.engine

EXAMPLE_RUNS = {
    "test_grpo_tiny_from_the_lightning_cli_yaml": lambda folder: [
        str(EXAMPLES / "grpo_tiny.py"),
        "fit",
        "--config",
        str(EXAMPLES / "grpo_tiny.yaml"),
        "--trainer.max_steps",
        "2",
    ],
    "test_grpo_tiny_lora_on_two_processes_with_fsdp2_pushes_the_adapter_logs_and_plots": lambda folder: [
        str(EXAMPLES / "grpo_tiny.py"),
        *["--devices", "2", "--steps", "4", "--lora-rank", "8", "--log-dir", str(folder / "logs")],
    ],
}


def test_grpo_tiny_from_the_lightning_cli_yaml(example_run):
    folder, run = example_run
    run.finish()
    log_dir = folder / "lightning_logs" / "grpo_tiny_cli" / "version_0"
    assert [value for _, value in tensorboard_scalars(log_dir, "vllm/weight_version")] == [1.0, 2.0]


def test_grpo_tiny_lora_on_two_processes_with_fsdp2_pushes_the_adapter_logs_and_plots(example_run):
    folder, run = example_run
    completed = run.finish()
    log_dir = folder / "logs" / "grpo_tiny" / "version_0"
    # Fit start, then steps 2 and 4, every rank taking part in each push.
    assert [value for _, value in tensorboard_scalars(log_dir, "vllm/weight_version")] == [1.0, 2.0, 3.0]
    # Fit start sends the base weights with the adapter, steps 2 and 4 the adapter alone (on this
    # tiny model, rank 8 on every projection is a sixth of the weights).
    first, *later = [value for _, value in tensorboard_scalars(log_dir, "vllm/sync_bytes")]
    assert len(later) == 2 and later[0] == later[1] and 5 * later[0] < first
    # The demo's logs, plot and samples (the single-process demo runs the same code: the
    # LightningCLI test above and `make demo` run it on one process).
    assert (log_dir / "grpo_tiny.png").stat().st_size > 10_000
    for tag in ("reward", "loss", "vllm/sync_seconds", "vllm/staleness"):
        assert tensorboard_scalars(log_dir, tag), tag
    assert completed.stdout.count("Samples before training") == 1  # printed by rank 0 only
    assert completed.stdout.count("Samples after training") == 1
    assert f"tensorboard --logdir {folder / 'logs'}" in completed.stdout
