"""What an adapter push sends, and the checks that decide whether an engine can serve it (no engine)."""

from __future__ import annotations

import pytest
import torch
from helpers import FakeEngine, tiny_qwen2

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.lora.adapter import AdapterWeights, WithAdapter, adapter_config, adapter_source
from lightning_vllm.lora.serving import LoraLimits, adapter_problems
from lightning_vllm.weights import source_metadata
from lightning_vllm.weights.checks import ExpectedWeights
from lightning_vllm.weights.sources import LoraBaseWeights, ModuleWeights

LIMITS = LoraLimits(max_lora_rank=8, max_loras=1)


def peft_policy(r: int = 4, targets=("q_proj", "v_proj"), **config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **config)
    return get_peft_model(tiny_qwen2(seed=0), lora)


def expected(model=None) -> ExpectedWeights:
    return ExpectedWeights(source_metadata(ModuleWeights(model or tiny_qwen2())), ties_word_embeddings=False)


def test_the_adapter_is_sent_under_peft_names_with_its_config():
    policy = peft_policy()
    source = AdapterWeights(policy)
    names = [meta.name for meta in source.metadata()]
    assert names[:2] == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    assert len(names) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    sent = dict(source)
    assert torch.equal(sent[names[0]], layer.lora_A["default"].weight)
    assert adapter_config(policy) == source.adapter_config
    assert source.adapter_config["r"] == 4 and source.adapter_config["target_modules"] == ["q_proj", "v_proj"]


def test_the_first_push_sends_the_base_weights_then_the_adapter_in_groups_of_their_own():
    policy = peft_policy()
    source = WithAdapter(LoraBaseWeights(policy), AdapterWeights(policy))
    names = [name for name, _ in source]
    assert names == [meta.name for meta in source.metadata()]
    groups = source.groups()
    assert [name for group in groups for name in group] == names  # vLLM's grouping would interleave them
    assert names.index("lm_head.weight") < names.index(next(n for n in names if n.startswith("base_model.model.")))
    assert adapter_source(policy, with_base=True)[1]["r"] == 4


def test_an_engine_that_can_serve_the_adapter_has_no_problem():
    assert adapter_problems(peft_policy(), LIMITS, expected(), "test") == []


@pytest.mark.parametrize(
    ("policy", "limits", "problem"),
    [
        (lambda: peft_policy(), None, "built without LoRA: build it with enable_lora=True"),
        (lambda: peft_policy(r=16), LIMITS, "LoRA rank 16 is greater than max_lora_rank 8"),
        (lambda: peft_policy(use_dora=True), LIMITS, "vLLM does not yet support DoRA"),
        (lambda: peft_policy(targets=["lm_head"]), LIMITS, "vLLM does not serve LoRA on lm_head"),
        (lambda: peft_policy(targets=["embed_tokens"]), LIMITS, "vLLM adapts linear layers"),
        (
            lambda: peft_policy(),
            LoraLimits(max_lora_rank=8, max_loras=1, target_modules=("o_proj",)),
            "the engine limits LoRA to ['o_proj'], not q_proj",
        ),
    ],
    ids=["no-lora", "rank", "dora", "lm_head", "embedding", "engine-targets"],
)
def test_what_an_engine_cannot_serve_is_named(policy, limits, problem):
    problems = adapter_problems(policy(), limits, expected(), "test")
    assert any(problem in found for found in problems), problems


def test_base_weights_that_train_cannot_ride_on_an_adapter():
    policy = peft_policy()
    policy.base_model.model.lm_head.weight.requires_grad_(True)
    (problem,) = adapter_problems(policy, LIMITS, expected(), "test")
    assert "1 parameter(s) outside the adapter are trained (e.g. lm_head.weight)" in problem


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="Must be 'auto', 'adapter' or 'merged'"):
        VLLMUpdater(lora="both")  # type: ignore[arg-type]


def test_adapter_mode_refuses_an_engine_without_lora_before_any_byte_moves():
    policy = peft_policy()
    engine = FakeEngine(tiny_qwen2())
    with pytest.raises(EngineConfigError, match="lora='adapter' but the adapter cannot be served: fake test engine"):
        VLLMUpdater(engine=engine, lora="adapter").push_weights(policy)
    assert engine.num_updates == 0


def test_adapter_mode_refuses_a_policy_without_lora():
    with pytest.raises(ValueError, match="lora='adapter' needs a PEFT LoRA policy"):
        VLLMUpdater(engine=FakeEngine(tiny_qwen2()), lora="adapter").push_weights(tiny_qwen2())


def test_auto_sends_merged_weights_to_an_engine_without_lora():
    policy = peft_policy()
    engine = FakeEngine(tiny_qwen2())
    updater = VLLMUpdater(engine=engine)
    stats = updater.push_weights(policy)
    assert stats.num_bytes == sum(t.numel() * t.element_size() for _, t in LoraBaseWeights(policy))
    assert set(engine.weights) == set(dict(LoraBaseWeights(policy)))
    assert updater.lora_request is None
