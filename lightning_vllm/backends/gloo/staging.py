"""The trainer's staging memory: one buffer of one bucket, handed out as a ring, and what each
segment of a sync sends from it (``segment_payloads``).

Packing small tensors and converting dtypes need a copy; the copy must live until
the asynchronous broadcast reading it has finished. Regions are taken in order
around one buffer, and a region is handed out again only after the broadcasts
that read the bytes it overlaps have finished, so copies for the next segments
proceed while earlier ones are still on the wire, and staging never exceeds the
buffer's capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lightning_vllm.backends.gloo.buckets import TensorSpec


class StagingRing:
    """Regions of one ``uint8`` buffer of ``capacity`` bytes, allocated when first needed.

    Example:
        >>> ring = StagingRing(16)
        >>> region, tensor = ring.take(8, make_room=lambda: None)
        >>> region, tensor.numel()
        ((0, 8), 8)
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"Invalid staging capacity {capacity}; it must be > 0 bytes.")
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None  # allocated at the first take
        self._head = 0
        self._held: deque[tuple[int, int, Any]] = deque()

    def reset(self) -> None:
        """Start again at the buffer's beginning; only call once nothing is in flight.

        Restarting each sync keeps the touched (resident) part of the buffer as small
        as the largest sync's staging needs.
        """
        self._head = 0
        self._held.clear()

    def take(self, num_bytes: int, make_room: Callable[[], None]) -> tuple[tuple[int, int], torch.Tensor]:
        """A free region of ``num_bytes``; calls ``make_room`` (which must finish the oldest
        broadcast in flight) until the region no longer overlaps bytes still being read."""
        if not 0 < num_bytes <= self.capacity:
            raise ValueError(f"Cannot stage {num_bytes} bytes in a staging buffer of {self.capacity} bytes.")
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8)
        begin = self._head if self._head + num_bytes <= self.capacity else 0
        end = begin + num_bytes
        while any(
            begin < held_end and held_begin < end and not work.is_completed()
            for held_begin, held_end, work in self._held
        ):
            make_room()
            self._drop_finished()
        self._drop_finished()
        self._head = end
        return (begin, end), self._buffer[begin:end]

    def hold(self, region: tuple[int, int], work: Any) -> None:
        """Keep ``region`` busy until ``work`` (the broadcast reading it) has completed."""
        self._held.append((*region, work))

    def _drop_finished(self) -> None:
        while self._held and self._held[0][2].is_completed():
            self._held.popleft()


def segment_payloads(
    specs: Sequence[TensorSpec],
    tensors: Sequence[torch.Tensor],
    ring: StagingRing,
    bucket_size_bytes: int,
    make_room: Callable[[], None],
) -> Iterator[tuple[torch.Tensor, tuple[int, int] | None]]:
    """The ``uint8`` tensors to send for one segment, with the ring region each one uses (if any).

    A lone tensor already in the wire dtype is sent from its own memory; a lone tensor to convert
    goes slice by slice, so a huge one needs one bucket at most; several are packed into one region.
    """
    if len(tensors) == 1 and _is_wire_ready(tensors[0], specs[0]):
        data = tensors[0].reshape(-1).view(torch.uint8)  # sent from the source's memory, no copy
        for begin in range(0, data.numel(), bucket_size_bytes):
            yield data[begin : begin + bucket_size_bytes], None
        return
    if len(tensors) == 1:
        spec, flat = specs[0], tensors[0].reshape(-1)
        per_slice = bucket_size_bytes // spec.dtype.itemsize
        for begin in range(0, flat.numel(), per_slice):
            part = flat[begin : begin + per_slice]
            region, staging = ring.take(part.numel() * spec.dtype.itemsize, make_room)
            staging.view(spec.dtype).copy_(part)  # converts to the wire dtype on the way
            yield staging, region
        return
    region, staging = ring.take(sum(spec.num_bytes for spec in specs), make_room)
    offset = 0
    for spec, tensor in zip(specs, tensors):
        staging[offset : offset + spec.num_bytes].view(spec.dtype).view(spec.shape).copy_(tensor)
        offset += spec.num_bytes
    yield staging, region


def _is_wire_ready(tensor: torch.Tensor, spec: TensorSpec) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == spec.dtype and tensor.is_contiguous()
