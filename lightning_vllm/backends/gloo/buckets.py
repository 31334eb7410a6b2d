"""How tensors are grouped into fixed-size buckets on the wire, and staged on the trainer to be sent.

Both halves of a transfer follow one layout, made by the trainer and shipped to the
workers in the single ``update_weights`` call of a sync, so they cannot split the
byte stream differently. A layout keeps whole layers together (vLLM's
``layerwise_groups``) while they fit in a bucket: vLLM's layer-wise reload
re-processes a layer once all of its tensors have arrived, so a bucket that ends on
a layer boundary lets the worker finish that layer before the next bucket lands.

A bucket never holds more than ``bucket_size_bytes`` unless a single tensor is
larger than that; such a tensor travels alone, in slices of at most
``bucket_size_bytes``, so the trainer's staging memory stays one bucket.

Within a bucket, tensors travel in *segments*, one broadcast each (or one per
slice). A tensor of at least ``coalesce_bytes`` is a segment of its own and is sent
straight from the trainer's memory, without a copy; smaller neighbours are packed
together, so small tensors do not pay a broadcast each. The receiver loads each
segment as soon as it lands, while the next ones are still on the wire.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Below this, a broadcast's fixed cost outweighs the copy that packing costs.
DEFAULT_COALESCE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    """What the receiver needs to rebuild one tensor: name, wire dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """A run of consecutive tensors ``specs[start:stop]`` sent as one byte range."""

    start: int
    stop: int
    num_bytes: int


def cut_into_buckets(groups: Sequence[Sequence[TensorSpec]], bucket_size_bytes: int) -> list[Bucket]:
    """Split tensors, given as layer groups in send order, into buckets.

    A group is added whole to the open bucket while it fits; a group that does not
    fit starts a new bucket; a group larger than a bucket is split between tensors;
    a tensor larger than a bucket gets a bucket of its own.

    Args:
        groups: tensor specs grouped per layer, in the order they will be sent.
        bucket_size_bytes: the largest number of bytes a bucket holds.

    Returns:
        Buckets indexing the flattened list of specs.
    """
    if bucket_size_bytes <= 0:
        raise ValueError(f"Invalid value for bucket_size_bytes={bucket_size_bytes}. Must be > 0.")
    buckets: list[Bucket] = []
    start = index = size = 0

    def close() -> None:
        nonlocal start, size
        if index > start:
            buckets.append(Bucket(start, index, size))
        start, size = index, 0

    for group in groups:
        group_bytes = sum(spec.num_bytes for spec in group)
        if size and size + group_bytes > bucket_size_bytes:
            close()
        for spec in group:
            if size and size + spec.num_bytes > bucket_size_bytes:
                close()
            index += 1
            size += spec.num_bytes
    close()
    return buckets


@dataclass(frozen=True)
class Segment:
    """Tensors ``specs[start:stop]`` sent as one byte range, ``offset`` bytes into their bucket."""

    start: int
    stop: int
    offset: int
    num_bytes: int

    def slices(self, bucket_size_bytes: int) -> Iterator[tuple[int, int]]:
        """Byte ranges, relative to the bucket, of the broadcasts that carry this segment."""
        for begin in range(0, self.num_bytes, bucket_size_bytes):
            yield self.offset + begin, self.offset + min(begin + bucket_size_bytes, self.num_bytes)


def choose_segment_ends(specs: Sequence[TensorSpec], buckets: Sequence[Bucket], coalesce_bytes: int) -> list[int]:
    """Where segments end (index one past their last tensor), bucket by bucket.

    Every bucket end is a segment end. A tensor of ``coalesce_bytes`` or more is a
    segment alone; runs of smaller ones are packed up to ``coalesce_bytes``.
    """
    if coalesce_bytes <= 0:
        raise ValueError(f"Invalid value for coalesce_bytes={coalesce_bytes}. Must be > 0.")
    ends: list[int] = []
    for bucket in buckets:
        size = 0
        for index in range(bucket.start, bucket.stop):
            num_bytes = specs[index].num_bytes
            if size and (num_bytes >= coalesce_bytes or size + num_bytes > coalesce_bytes):
                ends.append(index)
                size = 0
            size += num_bytes
        ends.append(bucket.stop)
    return ends


def bucket_segments(specs: Sequence[TensorSpec], bucket: Bucket, segment_ends: Sequence[int]) -> list[Segment]:
    """The segments of ``bucket``, given every segment end of the layout."""
    segments = []
    start = bucket.start
    offset = 0
    for end in segment_ends:
        if end <= bucket.start or end > bucket.stop:
            continue
        num_bytes = sum(spec.num_bytes for spec in specs[start:end])
        segments.append(Segment(start, end, offset, num_bytes))
        start, offset = end, offset + num_bytes
    return segments


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (uint8) as the named tensors it carries, in order."""
    pieces = buffer.split([spec.num_bytes for spec in specs])
    return [(spec.name, piece.view(spec.dtype).view(spec.shape)) for spec, piece in zip(specs, pieces)]


def piece_slices(num_bytes: int, bucket_size_bytes: int) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` of each slice a piece of ``num_bytes`` moves in (none for an empty piece).

    Example::

        >>> list(piece_slices(10, 4))
        [(0, 4), (4, 8), (8, 10)]
    """
    for begin in range(0, num_bytes, bucket_size_bytes):
        yield begin, min(begin + bucket_size_bytes, num_bytes)


# The trainer's staging memory: one buffer of one bucket, handed out as a ring, and what each segment of a
# sync sends from it. Packing small tensors and converting dtypes need a copy, which must live until the
# asynchronous broadcast reading it has finished. A region is handed out again only after the broadcasts
# that read the bytes it overlaps have finished, so copies for the next segments proceed while earlier ones
# are on the wire, and staging never exceeds one bucket.


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
