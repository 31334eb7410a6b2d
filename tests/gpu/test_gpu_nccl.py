"""``nccl`` into vLLM's own engine on a GPU of its own: the trainer on GPU 0 and a ``vllm.LLM`` on GPU 1.

NCCL puts each rank of a group on a GPU of its own, so this needs two GPUs; with one, every test here is
skipped, saying so (``test_gpu_refusals.py`` checks, on one GPU, that an engine on the trainer's own GPU is
refused). Written before a host with two GPUs was lent: not run yet (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    engines_start_on_second_gpu,
    fit_lands_within_the_floor,
    gpu_llm,
    push_killed_half_way,
    stop_llm,
)

from lightning_vllm._waits import call_with_timeout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="nccl into vLLM's own engine needs two GPUs, the trainer on one and the engine on another: NCCL puts "
        "each rank of a group on a GPU of its own",
    ),
]


@pytest.fixture(scope="module")
def nccl_llm(gpu_model_dir: Path) -> Iterator[Any]:
    """A ``vllm.LLM`` over ``nccl`` whose engine core sees the second GPU only; the trainer keeps the first."""
    with engines_start_on_second_gpu():
        llm = gpu_llm(gpu_model_dir, backend="nccl")
    yield llm
    stop_llm(llm)


def test_fit_pushes_over_nccl_land_within_the_engines_own_float32_floor(nccl_llm, tmp_path):
    fit_lands_within_the_floor(nccl_llm, tmp_path, figures_prefix="nccl_")


def test_the_engine_core_killed_mid_push_over_nccl_is_an_error_within_the_timeout_and_no_gpu_hangs(nccl_llm):
    """Last in this file: it ends the engine."""
    timeout = 20.0
    error, elapsed = push_killed_half_way(nccl_llm, timeout)
    FIGURES.update(nccl_kill_error_seconds=elapsed)
    print(f"engine core killed mid-push over nccl: {type(error).__name__} after {elapsed:.1f} s: {error}")
    assert elapsed < timeout + 5

    def the_trainers_gpu_answers() -> None:
        torch.ones(1, device="cuda:0").add_(1)
        torch.cuda.synchronize(0)

    # A broadcast left waiting for the dead rank would hold the trainer's stream: bounded, not a hang.
    call_with_timeout(the_trainers_gpu_answers, timeout=30, what="the trainer's GPU to answer after the kill")
