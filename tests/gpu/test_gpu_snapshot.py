"""Snapshots of background pushes on a GPU (``weights/snapshot.py``), engine-free: the copy is queued on the
weights' GPU without the host waiting for it, holds the weights of its push point though they are overwritten
at once, and goes to pinned host memory, warning once, when the GPU has no room."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from helpers import tiny_qwen2
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights import MappingWeights, ModuleWeights
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.snapshot import SnapshotMemory

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of an H200's clock, to keep a stream busy


def big_tensors(num_tensors: int = 8, numel: int = 1 << 24) -> dict[str, torch.Tensor]:
    """``num_tensors`` float32 tensors of 64 MiB each on the GPU, of different values."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    return {
        f"model.layers.{index}.weight": torch.randn(numel, device="cuda", generator=generator)
        for index in range(num_tensors)
    }


class Doubled(Weights):
    """Computes each tensor as it is read (as merged LoRA weights and gathered shards are), then drops it."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def declare(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, tensor * 2) for name, tensor in self.tensors.items())


def test_a_device_snapshot_is_queued_and_keeps_its_push_points_weights_though_they_are_overwritten_at_once():
    tensors = big_tensors()
    expected = {name: tensor.clone() for name, tensor in tensors.items()}
    memory = SnapshotMemory()
    dict(memory.take(MappingWeights(tensors)))  # the buffers are allocated (cudaMalloc may wait for the GPU)
    torch.cuda._sleep(BUSY_CYCLES)  # the training stream is busy: copies queued behind it cannot have run
    snapshot = memory.take(MappingWeights(tensors))
    assert not snapshot.copies_done()  # take did not wait for the GPU
    with torch.no_grad():
        for tensor in tensors.values():  # the next optimizer step, queued as soon as take returned
            tensor.mul_(-3.0).add_(1.0)
    assert memory.where == "device"
    copied = dict(snapshot)  # waits for the copies
    assert snapshot.copies_done()
    for name, buffer in copied.items():
        assert buffer.device == tensors[name].device
        assert torch.equal(buffer, expected[name]), f"{name}: the snapshot does not hold its push point's weights"
        assert torch.equal(tensors[name], expected[name] * -3.0 + 1.0)  # and the write did land, after the copy


def test_a_tensor_computed_as_it_is_read_is_copied_after_it_was_computed_and_before_its_memory_is_reused():
    bases = big_tensors()
    memory = SnapshotMemory()
    dict(memory.take(Doubled(bases)))  # buffers allocated, and blocks of the doubled tensors' size cached
    torch.cuda._sleep(BUSY_CYCLES)  # each doubled tensor is computed (on the caller's stream) behind this
    snapshot = memory.take(Doubled(bases))
    # Memory of the dropped doubled tensors, were it handed out again, would be overwritten by these.
    _reused = [torch.full_like(base, 7.0) for base in bases.values()]
    copied = dict(snapshot)
    assert all(torch.equal(copied[name], base * 2) for name, base in bases.items())


def test_device_buffers_are_kept_and_unchanged_tensors_are_not_copied_again():
    model = tiny_qwen2(seed=0).cuda()
    memory = SnapshotMemory()
    source = ModuleWeights(model)
    first = dict(memory.take(source, source.stamps()))
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    second = dict(memory.take(source, source.stamps()))
    assert memory.where == "device"
    assert memory.num_copied_bytes == model.model.norm.weight.numel() * 4
    assert all(first[name].data_ptr() == second[name].data_ptr() and second[name].is_cuda for name in first)
    assert all(torch.equal(second[name], tensor) for name, tensor in source)


def test_without_room_on_the_gpu_the_snapshot_goes_to_pinned_host_memory_and_says_so_once(monkeypatch, caplog):
    tensors = big_tensors(num_tensors=2)
    _, total = torch.cuda.mem_get_info()
    memory = SnapshotMemory()
    with monkeypatch.context() as full, caplog.at_level(logging.WARNING, logger="lightning_vllm.weights.snapshot"):
        full.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, total))  # 1 GiB free: too little
        for _ in range(2):
            expected = {name: tensor.clone() for name, tensor in tensors.items()}
            copied = dict(memory.take(MappingWeights(tensors)))
            with torch.no_grad():
                for tensor in tensors.values():
                    tensor.add_(1.0)
            assert memory.where == "host"
            assert all(buffer.device.type == "cpu" and buffer.is_pinned() for buffer in copied.values())
            assert all(torch.equal(copied[name], expected[name].cpu()) for name in tensors)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per memory, not per push
    assert "pinned host memory" in warnings[0] and "blocking=True" in warnings[0] and "GB more" in warnings[0]
    copied = dict(memory.take(MappingWeights(tensors)))  # room again: the snapshot moves to the GPU
    assert memory.where == "device" and all(buffer.is_cuda for buffer in copied.values())
    assert all(torch.equal(copied[name], tensor) for name, tensor in tensors.items())
