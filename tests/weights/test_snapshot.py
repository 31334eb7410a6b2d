"""Snapshots of background pushes: a copy in kept memory, unchanged tensors not copied again."""

from __future__ import annotations

import torch
from helpers import tiny_qwen2

from lightning_vllm.lora.adapter import AdapterWeights
from lightning_vllm.weights import ModuleWeights
from lightning_vllm.weights.snapshot import SnapshotMemory


def test_a_snapshot_keeps_the_weights_of_its_push_point_and_the_source_layout():
    model = tiny_qwen2(seed=0)
    source = ModuleWeights(model)
    memory = SnapshotMemory()
    snapshot = memory.take(source)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1)
    assert snapshot.metadata() == source.metadata() and snapshot.groups() == source.groups()
    copied = dict(snapshot)
    assert all(torch.equal(copied[name], before[name]) for name in before)
    assert memory.num_copied_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_unchanged_tensors_are_not_copied_again_and_buffers_are_reused():
    model = tiny_qwen2(seed=0)
    memory = SnapshotMemory()
    source = ModuleWeights(model)
    first = dict(memory.take(source, source.stamps()))
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    second = dict(memory.take(source, source.stamps()))
    assert memory.num_copied_bytes == model.model.norm.weight.numel() * 4
    assert all(first[name].data_ptr() == second[name].data_ptr() for name in first)  # the same memory
    assert torch.equal(second["model.norm.weight"], model.model.norm.weight)


def test_an_adapter_push_keeps_its_config_and_stamps_when_its_weights_are_a_snapshot():
    from peft import LoraConfig, get_peft_model

    from lightning_vllm.weights.payload import Payload

    policy = get_peft_model(tiny_qwen2(seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    source = AdapterWeights(policy)
    payload = Payload(source, "adapter", adapter_config=source.adapter_config, stamps={"x": ()})
    copied = payload.with_weights(SnapshotMemory().take(source))
    assert copied.adapter_config == source.adapter_config and copied.stamps == {"x": ()} and copied.view == "adapter"
    assert [meta.name for meta in copied.weights.metadata] == [meta.name for meta in source.metadata]
