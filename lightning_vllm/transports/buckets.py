"""How tensors are grouped into fixed-size buckets on the wire.

Both halves of a transfer follow one plan, made by the trainer and shipped to the
workers in the single ``update_weights`` call of a sync, so they cannot split the
byte stream differently. A plan keeps whole layers together (vLLM's
``layerwise_groups``) while they fit in a bucket: vLLM's layer-wise reload
re-processes a layer once all of its tensors have arrived, so a bucket that ends on
a layer boundary lets the worker finish that layer before the next bucket lands.

A bucket never holds more than ``bucket_size_bytes`` unless a single tensor is
larger than that; such a tensor travels alone, in slices of at most
``bucket_size_bytes``, so the trainer's staging memory stays one bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_SIZE_BYTES = 256 * 1024 * 1024


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

    def slices(self, bucket_size_bytes: int) -> Iterator[tuple[int, int]]:
        """Byte ranges of the broadcasts that carry this bucket, each at most ``bucket_size_bytes``."""
        for begin in range(0, self.num_bytes, bucket_size_bytes):
            yield begin, min(begin + bucket_size_bytes, self.num_bytes)


def plan_buckets(groups: Sequence[Sequence[TensorSpec]], bucket_size_bytes: int) -> list[Bucket]:
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


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (uint8) as the named tensors it carries, in order."""
    pieces = buffer.split([spec.num_bytes for spec in specs])
    return [(spec.name, piece.view(spec.dtype).view(spec.shape)) for spec, piece in zip(specs, pieces)]
