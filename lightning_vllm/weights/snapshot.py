"""A copy of what one push sends, taken at the push point, so training can go on while it is sent.

The copy lives in memory kept between pushes, one buffer per tensor, allocated at the
first snapshot and overwritten at the next. A tensor whose stamp
(``weights/base.py``) is the one it had at the last snapshot is not copied again:
frozen parameters cost their memory once and no time after.

Where the copy lives:

- **Weights on a CUDA GPU: on that GPU.** The copies are queued on a side stream kept by
  the memory, each behind the work the caller queued on its own stream before it (the
  optimizer step, or the tensor itself when the source computes it as it is read), and
  :meth:`SnapshotMemory.take` returns without waiting for them: the training thread is
  held for as long as it takes to queue them. Two orders keep the copy exact:

  * the caller's stream waits for the copies (a CUDA event, not the host), so the next
    optimizer step cannot write a parameter before it was copied; this costs the
    training stream one device-to-device copy of what changed, no host time;
  * the push's thread waits on the host for the same event before it hands a tensor on
    (:meth:`SnapshotWeights.iter_full`): vLLM reads the tensors on streams of its own,
    or in another process, which no stream order of ours reaches.

  A source tensor the copy reads is marked as used by the side stream
  (``Tensor.record_stream``), so PyTorch's caching allocator does not hand its memory to
  other work before the copy has read it (a merged LoRA weight or a gathered shard is
  freed as soon as the source moves on).
- **The GPU has no room: pinned host memory**, as before there were device snapshots. A
  snapshot goes on the GPU when the buffers it still has to allocate leave at least
  :data:`MIN_FREE_BYTES` or :data:`MIN_FREE_FRACTION` of the GPU free, whichever is more
  (:func:`snapshot_room`; free as the driver counts it, leaving out what PyTorch has
  cached, which the next training step's peak reuses). Otherwise the copy goes to the
  host and waits there for the copies (``torch.cuda.synchronize``), and the push copies it
  back to the GPU: on two H200s that held a training step 2.8 times longer than a
  blocking push (docs/runs.md). The memory warns once when that happens.
- **Weights in host memory: plain host buffers**, copied synchronously.

:attr:`SnapshotMemory.where` says where the last snapshot lives.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights.base import Stamp, Weights, same_stamp

log = logging.getLogger(__name__)

SnapshotPlace = Literal["device", "host"]
"""Where a snapshot lives: on the GPUs of the weights, or in host memory (part of it, at least)."""

MIN_FREE_BYTES = 1 << 30
"""A device snapshot leaves at least this much of its GPU free (and :data:`MIN_FREE_FRACTION`)."""

MIN_FREE_FRACTION = 0.05
"""A device snapshot leaves at least this part of its GPU's memory free (and :data:`MIN_FREE_BYTES`)."""

_GB = 1e9


def snapshot_room(*, num_needed_bytes: int, num_free_bytes: int, num_total_bytes: int) -> tuple[bool, str]:
    """Whether a snapshot may put its buffers on a GPU, and if not, why.

    Args:
        num_needed_bytes: the bytes of the buffers the snapshot has yet to allocate on the GPU
            (0 once they all are: a snapshot that has its buffers keeps them).
        num_free_bytes: the GPU's free memory, as ``torch.cuda.mem_get_info`` reports it.
        num_total_bytes: the GPU's memory.

    Returns:
        ``(fits, reason)``: ``fits`` when the buffers leave the larger of :data:`MIN_FREE_BYTES` and
        :data:`MIN_FREE_FRACTION` of the GPU free; ``reason`` says by how much they do not (empty if they fit).

    Example::

        >>> snapshot_room(num_needed_bytes=16 * 10**9, num_free_bytes=10 * 10**9, num_total_bytes=150 * 10**9)
        (False, 'it needs 16.0 GB more, and only 10.0 GB of its 150.0 GB are free (7.5 GB are kept free)')
    """
    keep = max(MIN_FREE_BYTES, int(MIN_FREE_FRACTION * num_total_bytes))
    if num_needed_bytes <= 0 or num_free_bytes - num_needed_bytes >= keep:
        return True, ""
    return False, (
        f"it needs {num_needed_bytes / _GB:.1f} GB more, and only {num_free_bytes / _GB:.1f} GB of its "
        f"{num_total_bytes / _GB:.1f} GB are free ({keep / _GB:.1f} GB are kept free)"
    )


def _holds(buffer: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``buffer`` can hold a tensor of that shape and dtype, where it is to live."""
    return tuple(buffer.shape) == tuple(shape) and buffer.dtype == dtype and buffer.device == device


def num_bytes_to_allocate(
    metadata: Sequence[ParamMeta], buffers: Mapping[str, torch.Tensor], device: torch.device
) -> int:
    """The bytes of the declared tensors that ``buffers`` cannot hold on ``device`` (missing, or of another
    shape, dtype or device): what a snapshot there would allocate.

    Example::

        >>> metadata = [ParamMeta("w", torch.float32, (2, 3)), ParamMeta("b", torch.bfloat16, (3,))]
        >>> num_bytes_to_allocate(metadata, {"w": torch.empty(2, 3)}, torch.device("cpu"))
        6
    """
    return sum(
        meta.dtype.itemsize * math.prod(meta.shape)
        for meta in metadata
        if (buffer := buffers.get(meta.name)) is None or not _holds(buffer, meta.shape, meta.dtype, device)
    )


class _DeviceCopies:
    """One snapshot's copies onto one GPU, queued on the memory's side stream behind the caller's stream."""

    def __init__(self, side: torch.cuda.Stream, device: torch.device) -> None:
        self.side = side
        self.caller = torch.cuda.current_stream(device)  # (each thread has its own)

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self.side):  # the buffer belongs to the stream that writes it
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)

    def copy(self, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        # Behind everything queued so far, each time: a source may compute a tensor as it is read.
        self.side.wait_stream(self.caller)
        with torch.cuda.stream(self.side):
            buffer.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.side)  # its memory is not reused before the copy has read it

    def end(self) -> torch.cuda.Event:
        """The event of the copies having landed; the caller's later work (the next optimizer step) waits for it."""
        copied = torch.cuda.Event()
        copied.record(self.side)
        self.caller.wait_event(copied)
        return copied


class SnapshotMemory:
    """The buffers of background pushes; :meth:`take` copies a source into them.

    One snapshot at a time: the caller takes the next one only after the push that
    sends the previous one has ended.

    Attributes:
        num_copied_bytes: the bytes copied by the last :meth:`take`.
        where: where the last snapshot lives (``None`` before the first); ``"host"`` if any
            of it does.

    Example::

        >>> from lightning_vllm.weights import MappingWeights
        >>> weight = torch.ones(2)
        >>> memory = SnapshotMemory()
        >>> snapshot = memory.take(MappingWeights({"w": weight}))
        >>> _ = weight.add_(1)
        >>> dict(snapshot)["w"], memory.where
        (tensor([1., 1.]), 'host')
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stamps: dict[str, Stamp] = {}
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._warned_no_room = False
        self.num_copied_bytes = 0
        self.where: SnapshotPlace | None = None

    def take(self, source: Weights, stamps: dict[str, Stamp] | None = None) -> SnapshotWeights:
        """Copy every tensor of ``source`` that changed since the last snapshot; returns the copy.

        ``stamps`` are the tensors' stamps now (``None``: every tensor is copied). The copy
        has the source's metadata and groups, so a push treats it as it would the source.
        Weights on a GPU with room for the copy return once the copies are queued (the module
        docstring says what orders them); otherwise once they have landed.
        """
        self.num_copied_bytes = 0
        on_device: dict[torch.device, _DeviceCopies | None] = {}  # per GPU met: its copies, None if to the host
        copied_from_gpu_to_host = False
        with torch.no_grad():
            for name, tensor in source:
                copies = self._copies_onto(tensor.device, source.metadata, on_device)
                buffer = self._buffers.get(name)
                target = tensor.device if copies is not None else torch.device("cpu")
                if buffer is None or not _holds(buffer, tensor.shape, tensor.dtype, target):
                    buffer = self._buffers[name] = self._allocate(tensor, copies)
                elif stamps is not None and same_stamp(self._stamps.get(name), stamps.get(name)):
                    continue  # unchanged since the last snapshot: the buffer holds it already
                if copies is not None:
                    copies.copy(buffer, tensor)
                else:
                    buffer.copy_(tensor, non_blocking=tensor.is_cuda)
                    copied_from_gpu_to_host |= tensor.is_cuda
                self.num_copied_bytes += buffer.numel() * buffer.element_size()
        if copied_from_gpu_to_host:
            torch.cuda.synchronize()  # the copies out of the device have landed
        self._stamps = dict(stamps) if stamps is not None else {}
        tensors = {meta.name: self._buffers[meta.name] for meta in source.metadata}
        self.where = "device" if tensors and all(buffer.is_cuda for buffer in tensors.values()) else "host"
        copied = [copies.end() for copies in on_device.values() if copies is not None]
        return SnapshotWeights(source, tensors, copied)

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates them again)."""
        self._buffers, self._stamps = {}, {}

    def _allocate(self, tensor: torch.Tensor, copies: _DeviceCopies | None) -> torch.Tensor:
        if copies is not None:
            return copies.allocate(tensor)
        # Pinned when the weights are on a GPU, so the copy out of it is a DMA that need not wait for the host.
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)

    def _copies_onto(
        self, device: torch.device, metadata: Sequence[ParamMeta], on_device: dict[torch.device, _DeviceCopies | None]
    ) -> _DeviceCopies | None:
        """This snapshot's copies onto ``device``, decided at its first tensor there; ``None``: they go to the host."""
        if device.type != "cuda":
            return None
        if device not in on_device:
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device=device)
            on_device[device] = _DeviceCopies(side, device) if self._room_on(device, metadata) else None
        return on_device[device]

    def _room_on(self, device: torch.device, metadata: Sequence[ParamMeta]) -> bool:
        """Whether the buffers not yet on ``device`` fit there (every declared tensor counts: with weights on
        several GPUs, that overestimates what one of them needs)."""
        num_needed = num_bytes_to_allocate(metadata, self._buffers, device)
        if num_needed == 0:
            return True
        num_free, num_total = torch.cuda.mem_get_info(device)
        fits, reason = snapshot_room(num_needed_bytes=num_needed, num_free_bytes=num_free, num_total_bytes=num_total)
        if not fits and not self._warned_no_room:
            self._warned_no_room = True
            log.warning(
                "The snapshots of background pushes (blocking=False) live in pinned host memory: %s has no room "
                "for them, %s. Each push point then waits for a copy of the weights to the host, and each push "
                "copies them back to the GPU, which can hold training longer than a blocking push. Leave the "
                "GPU that much memory (a smaller engine: gpu_memory_utilization), or push with blocking=True.",
                device,
                reason,
            )
        return fits


class SnapshotWeights(Weights):
    """A source's tensors as copied at a push point, under the source's names and groups.

    ``copied`` are the events of copies that may still be on their way to a GPU: reading the tensors waits
    for them.
    """

    def __init__(
        self, source: Weights, tensors: dict[str, torch.Tensor], copied: Sequence[torch.cuda.Event] = ()
    ) -> None:
        self._metadata = list(source.metadata)
        self._groups = source.groups()
        self._tensors = tensors
        self._copied = list(copied)

    def declare(self) -> list[ParamMeta]:
        return list(self._metadata)

    def groups(self) -> list[list[str]]:
        return [list(group) for group in self._groups]

    def copies_done(self) -> bool:
        """Whether every copy has finished (asked without waiting)."""
        return all(event.query() for event in self._copied)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, once their copies have landed: waits on the host, holding only the calling thread
        (the push's), since vLLM reads them on streams of its own or in another process."""
        for event in self._copied:
            event.synchronize()
        return ((meta.name, self._tensors[meta.name]) for meta in self._metadata)
