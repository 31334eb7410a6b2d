"""What changed since the last push: stamps read without touching a tensor's data, whole layer groups."""

from __future__ import annotations

import torch
from helpers import tiny_qwen2

from lightning_vllm.weights import MappingWeights, ModuleWeights, weights_from
from lightning_vllm.weights.changes import SentStamps, same_stamp, tensor_stamp, unchanged_names


def test_a_write_changes_the_stamp_and_a_read_does_not():
    weight = torch.zeros(3)
    before = tensor_stamp(weight)
    _ = weight.sum(), weight.clone()
    assert same_stamp((before,), (tensor_stamp(weight),))
    weight.add_(1)
    assert not same_stamp((before,), (tensor_stamp(weight),))


def test_a_freed_tensor_never_passes_for_a_new_one_in_its_memory():
    stamp = tensor_stamp(torch.zeros(1024))
    assert not same_stamp((stamp,), (tensor_stamp(torch.zeros(1024)),))  # freed: its stamp matches nothing


def test_an_optimizer_step_changes_trained_parameters_only():
    model = tiny_qwen2(seed=0)
    model.model.embed_tokens.weight.requires_grad_(False)
    source = ModuleWeights(model)
    before = source.stamps()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, 512, (2, 8))
    with torch.enable_grad():  # (whatever an earlier test left set)
        model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    after = source.stamps()
    assert before is not None and after is not None
    unchanged = {name for name in after if same_stamp(before[name], after[name])}
    assert unchanged == {"model.embed_tokens.weight"}
    assert unchanged_names(source.groups(), after, before) == {"model.embed_tokens.weight"}


def test_one_written_tensor_sends_its_whole_layer_group():
    model = tiny_qwen2(seed=0)
    source = ModuleWeights(model)
    sent = SentStamps()
    assert sent.unchanged(source.groups(), source.stamps()) == set()  # nothing sent yet: all of it
    sent.landed([meta.name for meta in source.metadata()], source.stamps())
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.mul_(2)
    unchanged = sent.unchanged(source.groups(), source.stamps())
    layer_1 = {name for name, _ in model.named_parameters() if name.startswith("model.layers.1.")}
    assert unchanged == {name for name, _ in model.named_parameters()} - layer_1
    sent.landed(layer_1, source.stamps())
    assert len(sent.unchanged(source.groups(), source.stamps())) == len(list(model.parameters()))
    sent.landed([], None)  # a push without stamps (an adapter, a sharded policy): what the engine holds is unknown
    assert sent.unchanged(source.groups(), source.stamps()) == set()


def test_merged_lora_weights_change_with_their_adapter():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_qwen2(seed=0), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    source = weights_from(policy)
    before = source.stamps()
    with torch.no_grad():
        policy.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(1)
    after = source.stamps()
    assert before is not None and after is not None
    changed = {name for name in after if not same_stamp(before[name], after[name])}
    assert changed == {"model.layers.0.self_attn.q_proj.weight"}


def test_dicts_of_live_tensors_are_stamped():
    weight = torch.zeros(2)
    assert MappingWeights({"w": weight}).stamps() is not None


def test_a_merged_lora_source_read_part_way_leaves_grad_mode_alone():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_qwen2(seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    tensors = iter(weights_from(policy))
    next(tensors)  # a reader that stops early (the tied-embedding check does)
    assert torch.is_grad_enabled()
