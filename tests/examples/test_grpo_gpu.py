"""examples/grpo_gpu.py (``make demo-gpu``): the engine it asks the callback to build, and its refusal without a GPU.
Its run belongs to the GPU host (issue 68)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import EXAMPLES


def example():
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("grpo_gpu", EXAMPLES / "grpo_gpu.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def test_the_engine_shares_the_gpu_over_lightning_ipc_with_the_options_as_flags():
    grpo_gpu = example()
    plain = grpo_gpu.engine_args(Path("/m"), sleep_level=None, fp8=False)
    assert plain["weight_transfer_config"] == {"backend": "lightning_ipc"} and plain["dtype"] == "bfloat16"
    assert "enable_sleep_mode" not in plain and "quantization" not in plain
    both = grpo_gpu.engine_args(Path("/m"), sleep_level=2, fp8=True)
    assert both["enable_sleep_mode"] is True and both["quantization"] == "fp8_per_tensor"


def test_an_engine_on_a_gpu_of_its_own_goes_over_lightning_nccl_and_needs_no_sleep(monkeypatch, capsys):
    import torch

    grpo_gpu = example()
    own = grpo_gpu.engine_args(Path("/m"), sleep_level=None, fp8=False, own_gpu=True)
    assert own["weight_transfer_config"] == {"backend": "lightning_nccl"} and own["gpu_memory_utilization"] > 0.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        grpo_gpu.main(["--engine-gpu", "1", "--sleep-level", "1"])
    assert "a GPU of its own needs none" in capsys.readouterr().err


def test_without_a_gpu_it_says_what_runs_on_cpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*make demo"):
        example().main([])
