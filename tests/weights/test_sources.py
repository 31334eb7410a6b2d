import copy

import pytest
import torch
from helpers import tiny_qwen2
from tensordict import TensorDict

from lightning_vllm.weights import EngineWeights, LoraMergedWeights, MappingWeights
from lightning_vllm.weights.layer_sums import SentSums
from lightning_vllm.weights.sources import ModuleWeights, source_metadata, weights_from


def test_module_weights_are_yielded_without_copies():
    model = tiny_qwen2()
    params = dict(model.named_parameters())
    for name, tensor in ModuleWeights(model):
        assert tensor.data_ptr() == params[name].data_ptr()


def test_metadata_reads_shapes_and_dtypes_only():
    model = tiny_qwen2()
    metadata = source_metadata(ModuleWeights(model))
    assert metadata["model.embed_tokens.weight"] == (torch.float32, torch.Size([512, 128]))
    assert list(metadata) == [name for name, _ in model.named_parameters()]


def test_meta_device_models_give_metadata_without_memory():
    with torch.device("meta"):
        model = tiny_qwen2()
    assert source_metadata(ModuleWeights(model))["lm_head.weight"] == (torch.float32, torch.Size([512, 128]))


def test_dicts_and_tensordicts_are_flattened_with_dots_and_stripped_of_wrappers():
    a, b = torch.zeros(2, 3), torch.ones(4)
    nested = {"model": {"norm": {"weight": b}}, "_orig_mod.lm_head.weight": a}
    flat = dict(MappingWeights(nested))
    assert list(flat) == ["model.norm.weight", "lm_head.weight"]
    assert flat["model.norm.weight"] is not None and torch.equal(flat["model.norm.weight"], b)
    assert torch.equal(flat["lm_head.weight"], a)
    td = TensorDict({"model": {"norm": {"weight": b}}, "lm_head": {"weight": a}}, [])
    assert source_metadata(MappingWeights(td)) == {
        "model.norm.weight": (torch.float32, torch.Size([4])),
        "lm_head.weight": (torch.float32, torch.Size([2, 3])),
    }


def test_names_that_collide_after_unwrapping_are_refused():
    with pytest.raises(ValueError, match="same checkpoint name.*lm_head.weight"):
        MappingWeights({"lm_head.weight": torch.zeros(1), "module.lm_head.weight": torch.zeros(1)})


def test_other_objects_are_refused_with_what_is_accepted():
    with pytest.raises(TypeError, match="Cannot push weights from a str.*dict of tensors or a TensorDict"):
        weights_from("weights.safetensors")
    with pytest.raises(TypeError, match="'x' is a int, not a tensor"):
        MappingWeights({"x": 3})


def lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    return get_peft_model(tiny_qwen2(seed), config)


def test_lora_weights_are_merged_under_base_names_without_touching_the_model():
    model = lora_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    merged = dict(weights_from(model))
    reference = copy.deepcopy(model).merge_and_unload()
    expected = dict(reference.named_parameters())
    assert isinstance(weights_from(model), LoraMergedWeights)
    assert merged.keys() == expected.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])  # bit-identical


def test_lora_metadata_matches_the_base_model():
    model = lora_model()
    assert source_metadata(weights_from(model)) == source_metadata(ModuleWeights(tiny_qwen2()))


def test_a_source_names_the_tensors_it_holds_only_when_it_sends_them_as_held():
    model = tiny_qwen2(tie_word_embeddings=True)
    names, tensors = ModuleWeights(model).held_tensors()
    assert names == [name for name, _ in ModuleWeights(model).iter_full()]
    assert all(held is param for held, param in zip(tensors, model.parameters()))
    assert weights_from(lora_model()).held_tensors() is None  # merged: computed for the push
    assert MappingWeights({"w": torch.ones(2)}).held_tensors() is None  # (not said: the default)
    engine_metadata = {name: (torch.bfloat16, None) for name in names if name != "model.norm.weight"}
    shown = EngineWeights(ModuleWeights(model), engine_metadata)  # converted on the way: still the tensors read
    assert shown.held_tensors()[0] == [name for name, _ in shown.iter_full()]
    tallied = EngineWeights(ModuleWeights(model), engine_metadata, sums=SentSums())
    assert tallied.held_tensors() is None  # each tensor is read as it goes


class _Told:
    """Records what :class:`SentSums` would be told."""

    def __init__(self, told: list[tuple[str, bool]]) -> None:
        self.told = told

    def tally(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, held: bool) -> None:
        self.told.append((name, held))


def test_the_tensors_a_source_holds_are_tallied_at_once_and_the_others_as_they_go():
    model = tiny_qwen2(tie_word_embeddings=True)
    metadata = {name: (torch.float32, None) for name, _ in ModuleWeights(model).iter_full()}
    for source, held in [(ModuleWeights(model), True), (weights_from(lora_model()), False)]:
        told: list[tuple[str, bool]] = []
        sent = EngineWeights(source, metadata, sums=_Told(told))  # type: ignore[arg-type]
        assert sent.tally_held() is held
        assert (sent.held_tensors() is not None) is held  # (a transport may keep what it sent: nothing to tally)
        names = [name for name, _ in sent.iter_full()]
        assert told == [(name, held) for name in names]
