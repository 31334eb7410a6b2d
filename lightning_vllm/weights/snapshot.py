"""A copy of what one push sends, taken at the push point, so training can go on while it is sent.

The copy lives in memory kept between pushes (host memory; pinned when the weights
are on a GPU, so the copy out of the device is a DMA), one buffer per tensor,
allocated at the first snapshot and overwritten at the next. A tensor whose stamp
(``weights/changes.py``) is the one it had at the last snapshot is not copied again:
frozen parameters cost their memory once and no time after.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.changes import Stamp, same_stamp


class SnapshotMemory:
    """The buffers of background pushes; :meth:`take` copies a source into them.

    One snapshot at a time: the caller takes the next one only after the push that
    sends the previous one has ended.

    Example::

        >>> from lightning_vllm.weights import MappingWeights
        >>> weight = torch.ones(2)
        >>> snapshot = SnapshotMemory().take(MappingWeights({"w": weight}))
        >>> _ = weight.add_(1)
        >>> dict(snapshot)["w"]
        tensor([1., 1.])
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stamps: dict[str, Stamp] = {}
        self.num_copied_bytes = 0  # bytes copied by the last take

    def take(self, source: Weights, stamps: dict[str, Stamp] | None = None) -> SnapshotWeights:
        """Copy every tensor of ``source`` that changed since the last snapshot; returns the copy.

        ``stamps`` are the tensors' stamps now (``None``: every tensor is copied). The copy
        has the source's metadata and groups, so a push treats it as it would the source.
        """
        self.num_copied_bytes = 0
        with torch.no_grad():
            for name, tensor in source:
                buffer = self._buffers.get(name)
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = self._buffers[name] = torch.empty(
                        tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda"
                    )
                elif stamps is not None and same_stamp(self._stamps.get(name), stamps.get(name)):
                    continue  # unchanged since the last snapshot: the buffer holds it already
                buffer.copy_(tensor, non_blocking=tensor.device.type == "cuda")
                self.num_copied_bytes += buffer.numel() * buffer.element_size()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies out of the device have landed
        self._stamps = dict(stamps) if stamps is not None else {}
        return SnapshotWeights(source, {meta.name: self._buffers[meta.name] for meta in source.metadata})

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates them again)."""
        self._buffers, self._stamps = {}, {}


class SnapshotWeights(Weights):
    """A source's tensors as copied at a push point, under the source's names and groups."""

    def __init__(self, source: Weights, tensors: dict[str, torch.Tensor]) -> None:
        self._metadata = list(source.metadata)
        self._groups = source.groups()
        self._tensors = tensors

    def declare(self) -> list[ParamMeta]:
        return list(self._metadata)

    def groups(self) -> list[list[str]]:
        return [list(group) for group in self._groups]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((meta.name, self._tensors[meta.name]) for meta in self._metadata)
