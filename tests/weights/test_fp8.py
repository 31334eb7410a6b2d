"""Block-wise FP8 on the trainer (weights/fp8.py): vLLM's own quantization bit for bit, an FP8 checkpoint read as the
engine holds it, the check before a push in the quantized form, and what a push sends. vLLM's CPU build cannot serve
FP8, so the engine's side runs in the GPU tier; here every piece is held against vLLM's code or a reference."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import save_file

from lightning_vllm.errors import WeightsMismatchError
from lightning_vllm.weights import ModuleWeights, checkpoint_weights, source_metadata
from lightning_vllm.weights.base import SentStamps
from lightning_vllm.weights.checks import ExpectedWeights, metadata_for_engine
from lightning_vllm.weights.fp8 import FP8, SCALE_SUFFIX, block_fp8, block_fp8_plan, quantized_metadata
from lightning_vllm.weights.layer_sums import tensor_sums
from lightning_vllm.weights.sources import EngineWeights


def block_friendly(seed: int) -> torch.nn.Module:
    """A tiny Qwen2 whose merged projections fill whole 128-row blocks (q and k 128 rows, gate 256): what an engine
    can hold block-wise (``tiny_qwen2``'s k of 64 rows cannot be)."""
    return tiny_model("qwen2", seed, intermediate_size=256, num_key_value_heads=2)


def vllms_per_block_cast(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_block_cast_to_fp8`` as written (its ``torch.compile`` wrapper set aside: the GPU tier runs it
    compiled)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8._torchdynamo_orig_callable(weight, [128, 128])


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (1, 1), (257, 129), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantizer_is_vllms_bit_for_bit_partial_edge_blocks_included(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * torch.logspace(-3, 2, shape[1])).to(dtype)
    weight[: min(shape[0], 128), : min(shape[1], 128)] = 0.0  # an all-zero block: its scale is clamped
    values, scales = block_fp8(weight)
    expected_values, expected_scales = vllms_per_block_cast(weight)
    assert values.dtype == FP8 and scales.dtype == torch.float32
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scales, expected_scales)


def fp8_checkpoint(model: torch.nn.Module, folder, quantized: set[str]) -> None:
    """``model``'s weights saved as an FP8 checkpoint: ``quantized`` block-wise, beside their scales; the rest bf16."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name in quantized:
            tensors[name], tensors[name + SCALE_SUFFIX] = block_fp8(tensor.to(torch.bfloat16))
        else:
            tensors[name] = tensor.to(torch.bfloat16).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))


def linear_weights(model: torch.nn.Module) -> set[str]:
    return {name for name, tensor in model.state_dict().items() if name.endswith("proj.weight")}


def test_an_fp8_checkpoint_is_read_as_the_engine_holds_it_and_pushes_are_checked_in_that_form(tmp_path):
    model = block_friendly(seed=1)
    quantized = linear_weights(model)
    fp8_checkpoint(model, tmp_path, quantized)
    expected = checkpoint_weights(tmp_path, serving_dtype=torch.bfloat16, ties_word_embeddings=False)
    assert block_fp8_plan(expected.weights) == quantized
    name = sorted(quantized)[0]
    assert expected.weights[name][0] == FP8 and expected.weights[name + SCALE_SUFFIX][0] == torch.float32
    assert expected.weights["model.norm.weight"][0] == torch.bfloat16

    trained = source_metadata(ModuleWeights(block_friendly(seed=2)))  # float32, as trained
    wire, _ = metadata_for_engine(expected, trained, "an FP8 engine")
    assert wire == expected.weights

    wrong = dict(trained)
    wrong[name] = (torch.float32, torch.Size([wrong[name][1][0], wrong[name][1][1] + 1]))
    with pytest.raises(
        WeightsMismatchError, match=r"nothing was sent(.|\n)*_scale_inv' has shape \(1, 3\), the engine's"
    ):
        metadata_for_engine(expected, wrong, "an FP8 engine")


def test_a_model_vllm_cannot_hold_block_wise_is_refused_naming_the_ways_that_serve_it():
    # SmolLM2-135M's attention: q 576 and k 192 rows, merged with v into one tensor vLLM cannot cut into 128-row blocks.
    shapes = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576)}
    metadata = {f"model.layers.0.self_attn.{p}.weight": (torch.bfloat16, torch.Size(s)) for p, s in shapes.items()}
    expected = ExpectedWeights(quantized_metadata(metadata, frozenset(metadata)), ties_word_embeddings=False)
    with pytest.raises(WeightsMismatchError) as raised:
        metadata_for_engine(expected, metadata, "an FP8 engine")
    message = str(raised.value)
    assert "q_proj.weight has 576 rows" in message and "k_proj.weight has 192 rows" in message
    assert "v_proj" not in message  # (the last shard may end in a partial block)
    assert "'fp8_per_tensor' or 'fp8_per_channel'" in message and "nothing was sent" in message


def test_a_push_sends_each_quantized_weight_followed_by_its_scales_in_its_layer_group():
    model = block_friendly(seed=3)
    quantized = frozenset(linear_weights(model))
    trained = source_metadata(ModuleWeights(model))
    wire = quantized_metadata(trained, quantized)
    sent = EngineWeights(ModuleWeights(model), wire)
    name = "model.layers.0.self_attn.q_proj.weight"
    group = next(group for group in sent.groups() if name in group)
    assert group[group.index(name) + 1] == name + SCALE_SUFFIX
    assert {meta.name: meta.dtype for meta in sent.declare()} == {name: dtype for name, (dtype, _) in wire.items()}
    tensors = dict(sent.iter_full())
    values, scales = block_fp8(model.state_dict()[name])
    assert torch.equal(tensors[name].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(tensors[name + SCALE_SUFFIX], scales)
    assert tensors["model.norm.weight"].dtype == torch.float32  # (not quantized: the engine's dtype)
    assert sent.held_tensors() is None  # (made per push: nothing is held to send as it is)


def test_the_fingerprints_of_fp8_values_and_their_scales_name_a_fault_in_one_blocks_scale():
    values, scales = block_fp8(torch.randn(256, 256, dtype=torch.bfloat16))
    faulty = scales.clone()
    faulty[1, 0] = faulty[1, 0] * 2
    assert not torch.equal(tensor_sums(scales), tensor_sums(faulty))
    flipped = values.view(torch.uint8).clone()
    flipped[200, 3] ^= 1
    assert not torch.equal(tensor_sums(values), tensor_sums(flipped.view(FP8)))


def test_a_changed_only_push_skips_an_unchanged_layers_weights_and_scales_together():
    model = block_friendly(seed=4)
    weights = ModuleWeights(model)
    wire = quantized_metadata(source_metadata(weights), frozenset(linear_weights(model)))
    groups = EngineWeights(weights, wire).groups()
    sent = SentStamps()
    sent.record(wire, weights.stamps())
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(1.0)
    unchanged = sent.unchanged(groups, ModuleWeights(model).stamps())
    layer_0 = {name for name in wire if ".layers.0." in name}
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in layer_0 and layer_0 <= unchanged
    assert not {name for name in unchanged if ".layers.1." in name}  # the written layer goes again, scales and all


def test_a_moe_policys_experts_held_fused_are_quantized_one_by_one_as_its_fp8_checkpoint_holds_them():
    from helpers import MOE_FAMILIES

    from lightning_vllm.weights import weights_from

    sizes = dict(MOE_FAMILIES["qwen3_moe"], moe_intermediate_size=128)
    model = tiny_model("qwen3_moe", 5, intermediate_size=128, num_key_value_heads=2, head_dim=64, **sizes)
    weights = weights_from(model)
    trained = source_metadata(weights)
    experts = {name for name in trained if ".experts." in name and name.endswith("proj.weight")}
    assert len(experts) == 2 * 4 * 3  # 2 layers, 4 experts, gate, up and down: transformers holds them fused
    wire = quantized_metadata(trained, frozenset(experts))
    sent = dict(EngineWeights(weights, wire).iter_full())
    fused = model.model.layers[1].mlp.experts.gate_up_proj[2]  # expert 2's gate and up, as transformers holds them
    assert fused.shape == (256, 128)
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    values, scales = block_fp8(fused[:128])  # its gate: a view into the fused tensor
    assert torch.equal(sent[name].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(sent[name + SCALE_SUFFIX], scales)


def test_a_dummy_engine_of_an_fp8_config_is_checked_and_sent_in_its_quantized_form():
    from lightning_vllm.weights.checks import config_weights

    model = block_friendly(seed=6)
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**config)
    expected = config_weights(hf_config, serving_dtype=torch.bfloat16, ties_word_embeddings=False)
    assert block_fp8_plan(expected.weights) == linear_weights(model)  # every projection; not lm_head, norms, embed
    assert expected.weights["lm_head.weight"][0] == torch.bfloat16
    wire, _ = metadata_for_engine(expected, source_metadata(ModuleWeights(model)), "a dummy FP8 engine")
    assert wire == expected.weights
