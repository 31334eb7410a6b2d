"""A model's weights in its checkpoint's layout: transformers' own reverse conversion, as views, per family."""

from __future__ import annotations

import pytest
import torch
from helpers import MOE_FAMILIES, NUM_EXPERTS, tiny_moe, tiny_qwen2
from transformers.core_model_loading import revert_weight_conversion

from lightning_vllm.errors import WeightsMismatchError
from lightning_vllm.weights import ModuleWeights, weights_from
from lightning_vllm.weights.base import unchanged_names
from lightning_vllm.weights.checkpoint_layout import CheckpointLayout, CheckpointWeights, moe_parts

FAMILIES = list(MOE_FAMILIES)


def saved_layout(model, tmp_path) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``save_pretrained`` writes: what vLLM loads."""
    from safetensors import safe_open

    model.save_pretrained(tmp_path)
    shapes = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as checkpoint:
            shapes.update({name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()})
    return shapes


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_shapes_are_the_saved_checkpoints(family, tmp_path):
    model = tiny_moe(family)
    source = weights_from(model)
    assert isinstance(source, CheckpointWeights)
    declared = {meta.name: tuple(meta.shape) for meta in source.metadata}
    saved = saved_layout(model, tmp_path)
    if model.config.tie_word_embeddings:  # (vLLM loads a tied output embedding from the input one)
        saved.pop("lm_head.weight", None)
    assert declared == saved


@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_equal_transformers_reverse_conversion_and_are_views(family):
    model = tiny_moe(family)
    source = weights_from(model)
    sent = list(source.iter_full())
    assert [name for name, _ in sent] == [meta.name for meta in source.metadata]
    reverted = revert_weight_conversion(model, dict(model.state_dict()))
    for name, tensor in sent:
        assert torch.equal(tensor, reverted[name]), name
        assert tensor.is_contiguous()
    held = {param.untyped_storage().data_ptr() for param in model.parameters()}
    copies = [name for name, tensor in sent if tensor.untyped_storage().data_ptr() not in held]
    buffers = {name for name, _ in model.named_buffers()}
    assert all(name in buffers for name in copies), f"copied, not viewed: {copies}"


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_follow_the_stream_and_split_a_moe_layer_into_vllms_units(family):
    source = weights_from(tiny_moe(family))
    groups = source.groups()
    assert [name for group in groups for name in group] == [meta.name for meta in source.metadata]
    experts = [group for group in groups if any(".experts.0." in name for name in group)]
    assert experts and all(all(".experts." in name for name in group) for group in experts)
    # Every routed expert of a layer in one group: vLLM's FusedMoE loads them as one module.
    assert all(len({name.split(".experts.")[0] for name in group}) == 1 for group in experts)
    assert all(len(group) == 3 * NUM_EXPERTS for group in experts)  # gate, up and down of each


def test_a_dense_layer_stays_whole():
    groups = [["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]]
    assert moe_parts(groups) == groups


def test_a_dense_model_is_sent_as_it_is():
    model = tiny_qwen2()
    assert type(weights_from(model)) is ModuleWeights
    assert CheckpointLayout.of(model) is None


def test_held_tensors_are_the_sent_views():
    model = tiny_moe("qwen3_moe")
    source = weights_from(model)
    names, tensors = source.held_tensors()
    sent = list(source.iter_full())
    assert names == [name for name, _ in sent]
    assert all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, (_, b) in zip(tensors, sent))


def test_frozen_experts_and_router_are_left_out_of_a_changed_only_push():
    model = tiny_moe("qwen3_moe")
    before = weights_from(model).stamps()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "self_attn" in name:
                param.add_(1)
    source = weights_from(model)
    unchanged = unchanged_names(source.groups(), source.stamps(), before)
    assert any(".experts." in name for name in unchanged)
    assert any(name.endswith("mlp.gate.weight") for name in unchanged)
    assert not any("self_attn" in name for name in unchanged)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[1].add_(1)  # one expert of layer 0 trained: its layer's experts go
    source = weights_from(model)
    unchanged = unchanged_names(source.groups(), source.stamps(), before)
    assert not any(name.startswith("model.layers.0.mlp.experts.") for name in unchanged)
    assert any(name.startswith("model.layers.1.mlp.experts.") for name in unchanged)


def test_the_metadata_is_converted_for_torchrl():
    from lightning_vllm import VLLMUpdater

    metadata = VLLMUpdater.get_model_metadata(tiny_moe("mixtral"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in metadata
    assert not any("gate_up_proj" in name for name in metadata)


def test_a_layout_transformers_cannot_revert_is_refused_naming_the_tensors():
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class OneWay(ConversionOps):
        """A conversion with no reverse (reverse_op raises NotImplementedError)."""

        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return input_dict

    model = tiny_moe("qwen3_moe")
    model._weight_conversions = [
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=[OneWay()])
    ]
    with pytest.raises(WeightsMismatchError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*nothing was sent"):
        weights_from(model)


def test_the_held_signature_names_the_fused_tensors_without_making_a_view():
    model = tiny_moe("qwen3_moe")
    source = weights_from(model)
    signature = source.held_signature()
    assert weights_from(model).held_signature() == signature  # the same plan, the same tensors: equal
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.down_proj.add_(1.0)  # written in place: the same memory, the same signature
    assert weights_from(model).held_signature() == signature
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().clone())  # new memory: another signature
    assert weights_from(model).held_signature() != signature


def test_a_buffer_the_checkpoint_holds_is_read_as_the_model_holds_it_at_each_push():
    model = tiny_moe("glm4_moe")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert dict(weights_from(model).iter_full())[name].abs().sum() == 0
    gate = model.model.layers[1].mlp.gate
    gate.e_score_correction_bias = torch.full_like(gate.e_score_correction_bias, 0.5)  # replaced, as .to() does
    source = weights_from(model)  # the same plan, kept for the model
    assert torch.equal(dict(source.iter_full())[name], gate.e_score_correction_bias)
