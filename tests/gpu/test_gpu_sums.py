"""The batched Triton sums (``weights/gpu_sums.py``) equal the per-tensor fingerprint on a real GPU."""

import pytest
import torch

from lightning_vllm.weights.gpu_sums import _sums_kernel
from lightning_vllm.weights.layer_sums import sums_as_ints, sums_of_many

pytestmark = pytest.mark.gpu  # (without it `make test-gpu`, which selects -m gpu, deselects these)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_launch_sums_every_tensor_as_the_per_tensor_kernel_does(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", generator=generator).to(dtype) for n in (1, 17, 4096, 16389, 3_000_001)]
    tensors.append(torch.randn(64, 33, device="cuda", generator=generator).to(dtype)[7])  # a row: a view at an offset
    tensors[2][3] = float("nan")
    batched = sums_as_ints(sums_of_many(tensors, [None] * len(tensors)))  # (the squares modulo 2**32, as compared)
    assert batched == sums_as_ints([_sums_kernel(t.reshape(-1)) for t in tensors])
    assert sums_as_ints(sums_of_many(tensors, [None] * len(tensors)))[4] == batched[4]  # (the launch table, kept)
