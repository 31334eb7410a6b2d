"""The check after every push names a layer a faulty load left otherwise than sent, at that push, on every backend
that reaches vLLM's own engine on a GPU (``lightning_ipc``'s, with a replay written one row off, are in
``tests/gpu/test_gpu_check.py``). A call of its own: ``make test-gpu-check-faults``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_helpers import changed_after_loading, digests_equal, engine_digest, model_digest, records_forgotten
from helpers import tiny_qwen2

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import LandedWeightsMismatchError

pytestmark = pytest.mark.gpu

MLP = "model.layers.1.mlp"


@pytest.fixture(params=["ipc", "nccl", "lightning_nccl"])
def gpu_llm(request: pytest.FixtureRequest, insecure_serialization: None) -> Any:
    """vLLM's own ``ipc`` and ``nccl`` engines (the worker reads every weight after the commit) and ours,
    ``lightning_nccl`` (the worker's copies from its staging room sum what they write); each started with
    cloudpickled RPCs, which the fault and the digests run by."""
    return request.getfixturevalue(f"{request.param}_llm")


def test_a_value_a_load_changed_after_its_copy_is_named_at_that_push_and_the_next_push_mends_it(gpu_llm):
    model = tiny_qwen2(seed=57).cuda()
    updater = VLLMUpdater(engine=gpu_llm, timeout_seconds=120)  # (checked: the default)
    updater.push_weights(model)
    # From the next push on, the engine's load adds 0.5 to one value of a linear layer after its loaders copied it in.
    changed_after_loading(gpu_llm, f"{MLP}.down_proj.weight")
    with torch.no_grad():
        model.get_submodule(f"{MLP}.down_proj").weight.add_(0.01)  # (a changed-only push sends that layer)
    with pytest.raises(LandedWeightsMismatchError, match=rf"1 layer\(s\), {MLP}\b") as caught:
        updater.push_weights(model)
    assert caught.value.layers == {0: [MLP]}
    records_forgotten(gpu_llm)  # (the engine's own load back)
    stats = updater.push_weights(model)  # every tensor again
    assert stats.checked_layers[0] == stats.checked_layers[1] > 0
    assert digests_equal(engine_digest(gpu_llm), model_digest(model))
    updater.push_weights(tiny_qwen2(seed=0).cuda())  # the shared engine serves what it started from again
    updater.close()
