"""examples/vllm_scalars.py draws every vllm/* scalar of a run's TensorBoard events, and nothing else."""

from __future__ import annotations

import importlib.util

from helpers import EXAMPLES
from lightning.pytorch.loggers import TensorBoardLogger


def test_every_vllm_scalar_of_a_run_is_read_and_drawn(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="run")
    for step in range(3):
        logger.log_metrics({"vllm/weight_version": step + 1.0, "vllm/sync_seconds": 0.1 * step, "loss": 1.0}, step)
    logger.finalize("success")
    spec = importlib.util.spec_from_file_location("vllm_scalars", EXAMPLES / "vllm_scalars.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    scalars = example.vllm_scalars(logger.log_dir)
    assert scalars == {
        "vllm/sync_seconds": [(0, 0.0), (1, 0.10000000149011612), (2, 0.20000000298023224)],
        "vllm/weight_version": [(0, 1.0), (1, 2.0), (2, 3.0)],
    }
    png = example.draw(scalars, tmp_path / "scalars.png", "a run")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
