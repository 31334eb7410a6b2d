"""docs/gpu.md's recipes (``examples/gpu_recipes.py``) at each model's real layer shape, on the one GPU
(``make test-gpu-recipes``): a bf16 trainer model of Qwen3-8B's and of Qwen3-30B-A3B's layer shape, with fewer layers
(one GPU holds the trainer's copy and the engine's), pushed over ``lightning_nccl`` into an engine started with the
recipe's arguments (its model, tensor-parallel size, memory share and length aside: a dummy load of the shape's
config, one GPU, a fraction of it), its engine core an NCCL host of its own (``nccl_hosts.py``, the tier's stand-in
for a GPU of its own). Every push lands digest-equal and is checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_helpers import bf16_model_on_gpu, digests_equal, dummy_bf16_llm, engine_digest, model_digest, stop_llm
from nccl_hosts import starting_as

from lightning_vllm import VLLMUpdater

sys.path.insert(0, str(Path(__file__).parents[3] / "examples"))

from gpu_recipes import RECIPES  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS = {"qwen3-8b": 2, "qwen3-30b-a3b": 2}
"""Layers built per recipe: 2 of Qwen3-8B's (with its embedding and head: 1.63B parameters, 3.3 GB in bf16; all 36:
8.19B) and 2 of Qwen3-30B-A3B's (1.87B, 3.7 GB; all 48: 30.5B)."""
SET_HERE = {"model", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "weight_transfer_config"}
"""The recipe's engine arguments this tier sets itself (``gpu_helpers.dummy_bf16_llm``, and see the module docstring);
the others are the recipe's."""


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipes_engine_takes_every_push_at_the_models_real_layer_shape(name, tmp_path, insecure_serialization):
    from transformers import AutoConfig

    recipe = RECIPES[name]
    layer = dict(recipe.layer)
    config = AutoConfig.for_model(layer.pop("model_type"), num_hidden_layers=LAYERS[name], **layer)
    config.torch_dtype = "bfloat16"
    model = bf16_model_on_gpu(config, tmp_path)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kept = {name: value for name, value in recipe.engine.items() if name not in SET_HERE}
    with starting_as("engine-recipe"):
        llm = dummy_bf16_llm(tmp_path, num_bytes, "lightning_nccl", **kept)
    try:
        assert not digests_equal(engine_digest(llm), model_digest(model))  # (the check below can fail)
        updater = VLLMUpdater(engine=llm, timeout_seconds=300)
        for push in range(2):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=1e-3)
            stats = updater.push_weights(model)
            checked, expected = stats.checked_layers
            assert checked == expected > 0, push
            assert digests_equal(engine_digest(llm), model_digest(model)), push
        print(f"recipe {name}: {num_bytes / 1e9:.1f} GB a push, {stats.seconds:.3f} s, {expected} layers checked")
        updater.close()
    finally:
        stop_llm(llm)
