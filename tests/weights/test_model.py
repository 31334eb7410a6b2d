import pytest
import torch
from helpers import TinyCausalLM, tiny_qwen2
from lightning.pytorch import LightningModule

from lightning_vllm.weights import canonical_name, find_hf_model


@pytest.mark.parametrize(
    ("wrapped", "name"),
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("_orig_mod.lm_head.weight", "lm_head.weight"),
        ("model._orig_mod.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
        ("module._orig_mod.model.norm.weight", "model.norm.weight"),
        (
            "base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight",
            "model.layers.1.self_attn.v_proj.weight",
        ),
        ("model.layers.0._fsdp_wrapped_module.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ],
)
def test_wrapper_segments_are_removed(wrapped, name):
    assert canonical_name(wrapped) == name


def test_a_lightning_module_is_searched_for_its_one_hf_model():
    hf = tiny_qwen2()
    assert find_hf_model(TinyCausalLM(hf, attribute="actor")) is hf
    assert find_hf_model(TinyCausalLM(torch.compile(hf, backend="eager"))) is hf


def test_an_attribute_can_name_the_model():
    hf = tiny_qwen2()
    module = TinyCausalLM(torch.compile(hf, backend="eager"), attribute="policy")
    assert find_hf_model(module, "policy") is hf
    with pytest.raises(ValueError, match="no module attribute 'actor'.*model_attribute"):
        find_hf_model(module, "actor")


def test_no_model_or_several_models_are_clear_errors():
    class Empty(LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(2, 2)

    class Two(LightningModule):
        def __init__(self):
            super().__init__()
            self.policy, self.reference = tiny_qwen2(), tiny_qwen2()

    with pytest.raises(ValueError, match="holds no Hugging Face PreTrainedModel"):
        find_hf_model(Empty())
    with pytest.raises(ValueError, match=r"several Hugging Face models \(policy, reference\).*model_attribute"):
        find_hf_model(Two())
    assert isinstance(find_hf_model(Two(), "reference"), torch.nn.Module)


def test_a_peft_model_is_found_whole():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_qwen2(), LoraConfig(r=4, target_modules=["q_proj"]))
    assert find_hf_model(TinyCausalLM(peft_model)) is peft_model
