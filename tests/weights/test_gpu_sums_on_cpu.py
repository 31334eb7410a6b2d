"""The batched sums' Triton kernel (``weights/gpu_sums.py``) equals the per-tensor sums, run under Triton's interpreter
on the CPU. The interpreter must be on before Triton is first imported, so the check runs in a process of its own;
the GPU tier runs the kernel compiled (tests/gpu/test_gpu_sums.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch
from lightning_vllm.weights.gpu_sums import batched_sums
from lightning_vllm.weights.layer_sums import tensor_sums, SQUARES_MODULUS

generator = torch.Generator().manual_seed(0)
tensors = [torch.randn(n, generator=generator).to(dtype) for n, dtype in (
    (1, torch.float32), (17, torch.bfloat16), (4096, torch.float32), (16389, torch.float16), (40000, torch.bfloat16))]
tensors[2][3] = float("nan")
# Whole spans (2**16 values) of the bfloat16 patterns largest in size (-0.0: -2**15; the largest finite value): their
# sums must not wrap in int32.
tensors += [torch.full((1 << 16,), -0.0, dtype=torch.bfloat16), torch.full((2 << 16,), 3.3e38, dtype=torch.bfloat16)]
rows = batched_sums(tensors)
assert rows is not None, "the kernel did not run"
for tensor, (bits, squares, not_finite) in zip(tensors, rows.tolist(), strict=True):
    assert [bits, squares % SQUARES_MODULUS, not_finite] == tensor_sums(tensor).tolist(), tensor.shape
again = batched_sums(tensors)  # (the launch tables, kept)
assert again is not None and torch.equal(again, rows)
print("passed")
"""


@pytest.mark.skipif(
    "LIGHTNING_VLLM_EXPECT_VLLM" not in os.environ,
    reason="run once, in make test-vllm-next, beside lightning_ipc's interpreted kernel (4 s of imports)",
)
def test_one_launch_sums_each_tensor_of_every_dtype_as_its_own_sums_do():
    pytest.importorskip("triton")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.strip().endswith("passed"), run.stdout
