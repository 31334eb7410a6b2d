"""Snapshots of background pushes: a copy in kept memory, unchanged tensors not copied again, and when a
snapshot of weights on a GPU goes to the host instead (on CPU; the device path is tested in tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_qwen2
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.lora.adapter import AdapterWeights
from lightning_vllm.weights import ModuleWeights
from lightning_vllm.weights.snapshot import SnapshotMemory, num_bytes_to_allocate, snapshot_room


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


def test_weights_in_host_memory_are_snapshot_in_plain_host_buffers():
    model = tiny_qwen2(seed=0)
    memory = SnapshotMemory()
    assert memory.where is None
    copied = dict(memory.take(ModuleWeights(model)))
    assert memory.where == "host"
    assert all(tensor.device.type == "cpu" and not tensor.is_pinned() for tensor in copied.values())


GB = 10**9


@pytest.mark.parametrize(
    ("needed", "free", "total", "fits"),
    [
        (0, 0, 150 * GB, True),  # every buffer is there already: nothing to allocate
        (16 * GB, 80 * GB, 150 * GB, True),
        (16 * GB, 16 * GB + 7.5 * GB, 150 * GB, True),  # exactly 5% left
        (16 * GB, 16 * GB + 7.5 * GB - 1, 150 * GB, False),
        (16 * GB, 10 * GB, 150 * GB, False),  # it does not fit at all
        (1 * GB, 1 * GB + (1 << 30), 16 * GB, True),  # a small GPU: 1 GiB is more than 5%
        (1 * GB, 1 * GB + (1 << 30) - 1, 16 * GB, False),
    ],
)
def test_a_snapshot_goes_on_the_gpu_when_it_leaves_1_gib_or_5_percent_free(needed, free, total, fits):
    decision, reason = snapshot_room(num_needed_bytes=needed, num_free_bytes=int(free), num_total_bytes=total)
    assert decision is fits
    assert (reason == "") is fits
    if not fits:
        assert f"{needed / GB:.1f} GB more" in reason and "kept free" in reason


def test_what_a_snapshot_would_allocate_counts_missing_buffers_and_those_of_another_layout():
    metadata = [
        ParamMeta("kept", torch.float32, (4, 2)),
        ParamMeta("missing", torch.bfloat16, (3,)),
        ParamMeta("other_shape", torch.float32, (5,)),
        ParamMeta("other_dtype", torch.float16, (2,)),
    ]
    buffers = {"kept": torch.empty(4, 2), "other_shape": torch.empty(4), "other_dtype": torch.empty(2)}
    assert num_bytes_to_allocate(metadata, buffers, torch.device("cpu")) == 3 * 2 + 5 * 4 + 2 * 2
    assert num_bytes_to_allocate(metadata, buffers, torch.device("meta")) == 4 * 2 * 4 + 3 * 2 + 5 * 4 + 2 * 2
