"""What both ends of a ``gloo`` sync agree on: the bucket layout, and the plain dataclasses that carry it.

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

The worker-side messages travel through vLLM's control plane (a Python call, an
HTTP body or a Ray call) as ``dataclasses.asdict`` output: lists, strings and
numbers. Dtypes travel by name and are checked against ``torch``'s dtypes, never
evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from typing_extensions import Self
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo

from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_TIMEOUT_SECONDS, validate_bucket_size

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


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a clear error for anything that is not a dtype.

    Example::

        >>> dtype_from_name("bfloat16")
        torch.bfloat16
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype name {name!r} in a weight update; expected e.g. 'float32' or 'bfloat16'.")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a vLLM worker needs to connect to the trainer (sent once, at init; ``group_name`` also lets it in)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        validate_bucket_size(self.bucket_size_bytes)
        if self.world_size < 2:
            raise ValueError(f"world_size={self.world_size} must count the trainer and at least one worker.")


@dataclass(kw_only=True)
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One sync's metadata and bucket layout (sent once per sync, before the bytes).

    ``bucket_ends[i]`` is the index one past the last tensor of bucket ``i``, and
    ``segment_ends`` the same for the segments (one broadcast each) inside the
    buckets; every bucket end is also a segment end.

    ``adapter`` is set when the update carries a LoRA adapter: ``{"key", "config"}``
    (where the workers stage it, and its PEFT config as JSON values); its tensors are
    the ones named ``base_model.model.*``, the others are base weights.

    ``pieces`` is set when every trainer rank sends a share of each tensor (a sharded
    policy, ``push_from="every_rank"``): ``pieces[i][k]`` is how many bytes of tensor ``i``
    trainer rank ``k`` sends, in rank order, which together make the tensor. Rank 0's
    come down the connection made at init; each other rank's down a connection the
    worker makes for this update to ``senders[k - 1]`` (``{"address", "port"}``), naming
    ``sender_group`` (fresh for each update, which is also what lets it in). Each piece
    travels in slices of at most ``bucket_size_bytes``, and there is no coalescing.

    ``fingerprinted``: the workers fingerprint the layers vLLM's CPU build processes as it
    processes them, for the check after the push (``weights/packed_sums.py``); an unchecked
    push sends ``False`` and spares the workers that read of every linear weight.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_ends: list[int]
    segment_ends: list[int]
    adapter: dict[str, Any] | None = None
    pieces: list[list[int]] | None = None
    senders: list[dict[str, Any]] = field(default_factory=list)
    sender_group: str = ""
    fingerprinted: bool = True

    def __post_init__(self) -> None:
        num_tensors = len(self.names)
        if len(self.dtype_names) != num_tensors or len(self.shapes) != num_tensors:
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor: got "
                f"{num_tensors}, {len(self.dtype_names)} and {len(self.shapes)}."
            )
        if self.bucket_ends != sorted(set(self.bucket_ends)) or (
            self.bucket_ends and self.bucket_ends[-1] != num_tensors
        ):
            raise ValueError(f"bucket_ends={self.bucket_ends} must rise strictly and end at {num_tensors}.")
        if self.segment_ends != sorted(set(self.segment_ends)) or not set(self.bucket_ends) <= set(self.segment_ends):
            raise ValueError(
                f"segment_ends={self.segment_ends} must rise strictly and include every bucket end {self.bucket_ends}."
            )
        if self.segment_ends and self.segment_ends[-1] != num_tensors:
            raise ValueError(f"segment_ends={self.segment_ends} must end at {num_tensors}.")
        if self.pieces is not None:
            self._check_pieces()

    def _check_pieces(self) -> None:
        assert self.pieces is not None
        if len(self.pieces) != len(self.names):
            raise ValueError(f"pieces must have one entry per tensor: got {len(self.pieces)} for {len(self.names)}.")
        for spec, pieces in zip(self.specs(), self.pieces):
            if len(pieces) != len(self.senders) + 1 or min(pieces, default=0) < 0 or sum(pieces) != spec.num_bytes:
                raise ValueError(
                    f"pieces of {spec.name!r} are {pieces}: they must be one count of bytes per trainer rank "
                    f"({len(self.senders) + 1}), none negative, adding up to its {spec.num_bytes} bytes."
                )
        if self.senders and not self.sender_group:
            raise ValueError("An update with senders must name their sender_group.")

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, dtype_from_name(dtype), tuple(shape))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes)
        ]

    def buckets(self, specs: Sequence[TensorSpec]) -> list[Bucket]:
        starts = [0, *self.bucket_ends[:-1]]
        return [
            Bucket(start, stop, sum(spec.num_bytes for spec in specs[start:stop]))
            for start, stop in zip(starts, self.bucket_ends)
        ]

    def segments(self, specs: Sequence[TensorSpec], bucket: Bucket) -> list[Segment]:
        return bucket_segments(specs, bucket, self.segment_ends)

    @classmethod
    def from_buckets(
        cls,
        specs: Sequence[TensorSpec],
        buckets: Sequence[Bucket],
        segment_ends: Sequence[int] | None = None,
        adapter: dict[str, Any] | None = None,
        fingerprinted: bool = True,
        **every_rank: Any,
    ) -> Self:
        """The message for a bucket layout; without ``segment_ends``, each bucket is one segment.
        ``every_rank``: the ``pieces``, ``senders`` and ``sender_group`` of a push every trainer
        rank sends a share of."""
        bucket_ends = [bucket.stop for bucket in buckets]
        return cls(
            names=[spec.name for spec in specs],
            dtype_names=[dtype_name(spec.dtype) for spec in specs],
            shapes=[list(spec.shape) for spec in specs],
            bucket_ends=bucket_ends,
            segment_ends=list(segment_ends) if segment_ends is not None else bucket_ends,
            adapter=adapter,
            fingerprinted=fingerprinted,
            **every_rank,
        )


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of the ``gloo`` backend.

    Args:
        master_address: address the trainer listens on; workers must reach it there.
        master_port: port to listen on; 0 lets the operating system pick a free one
            while the socket is held, so no other process can take it in between.
        world_size: the trainer plus every vLLM worker.
        bucket_size_bytes: the largest packed bucket, and the trainer's staging memory.
        timeout_seconds: the longest any single wait may take.

    Example::

        >>> GlooTrainerInitInfo(world_size=3).backend
        'gloo'
    """

    backend: ClassVar[str] = "gloo"

    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    rank: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        validate_bucket_size(self.bucket_size_bytes)
