"""The receiving end of a sync: a worker's place in the gloo group and its receive buffers.

Kept apart from vLLM's worker engine class so that it holds no vLLM state: the
worker engine (``worker.py``) hands what lands here to the model's loader.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from lightning_vllm.transports.buckets import unpack_bucket
from lightning_vllm.transports.gloo.group import join_store, local_address_towards, new_gloo_group, post_broadcast
from lightning_vllm.transports.gloo.messages import GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo

NamedTensors = list[tuple[str, torch.Tensor]]


class GlooReceiver:
    """One worker's membership of the trainer's gloo group.

    Args:
        init_info: the trainer's group, as sent at init.
        rank: this worker's rank in the group (the trainer is rank 0).

    Building it blocks until the trainer and every other worker have joined, or
    ``init_info.timeout_seconds`` pass.
    """

    def __init__(self, init_info: GlooWeightTransferInitInfo, rank: int) -> None:
        self.bucket_size_bytes = init_info.bucket_size_bytes
        self.timeout_seconds = init_info.timeout_seconds
        # The group needs the store to stay alive as long as it does.
        self._store: TCPStore = join_store(
            init_info.master_address, init_info.master_port, init_info.world_size, init_info.timeout_seconds
        )
        self._group: ProcessGroupGloo = new_gloo_group(
            self._store,
            init_info.group_name,
            rank=rank,
            world_size=init_info.world_size,
            address=local_address_towards(init_info.master_address),
            timeout_seconds=init_info.timeout_seconds,
        )
        self.kept_buffers: list[torch.Tensor] = []

    def received_segments(self, update_info: GlooWeightTransferUpdateInfo) -> Iterator[NamedTensors]:
        """Receive the sync's tensors in order; yields named tensors as soon as they have landed.

        The receives of the current and the next bucket are posted ahead, so gloo's
        threads take the next bytes off the wire while the caller loads the ones
        yielded. Each yield holds one or more whole segments. Every wait is bounded
        by the timeout given at init.
        """
        specs = update_info.specs()
        buckets = enumerate(update_info.buckets(specs))
        posted: deque[tuple[list[Any], NamedTensors, bool]] = deque()

        def post_next_bucket() -> None:
            bucket_index, bucket = next(buckets, (0, None))
            if bucket is None:
                return
            buffer = self._receive_buffer(bucket_index, bucket.num_bytes)
            segments = update_info.segments(specs, bucket)
            for index, segment in enumerate(segments):
                slices = segment.slices(self.bucket_size_bytes)
                works = [post_broadcast(self._group, buffer[begin:end]) for begin, end in slices]
                data = buffer[segment.offset : segment.offset + segment.num_bytes]
                tensors = unpack_bucket(data, specs[segment.start : segment.stop])
                posted.append((works, tensors, index == len(segments) - 1))

        def take() -> NamedTensors:
            works, tensors, ends_bucket = posted.popleft()
            for work in works:
                work.wait(datetime.timedelta(seconds=self.timeout_seconds))
            if ends_bucket:
                post_next_bucket()
            return tensors

        post_next_bucket()
        post_next_bucket()
        while posted:
            ready = take()
            while posted and all(work.is_completed() for work in posted[0][0]):
                ready += take()  # load what has already landed in one call
            yield ready

    def _receive_buffer(self, bucket_index: int, num_bytes: int) -> torch.Tensor:
        """Where bucket ``bucket_index`` of a sync lands: the same memory at every sync.

        Within a sync each bucket has its own buffer, because layer-wise reload keeps
        the loaded views until their layer is complete. Between syncs nothing refers
        to them any more (every layer has been processed into vLLM's own tensors), so
        they are kept and reused: fresh memory would be page-faulted in at every
        sync, which measured slower than the copy itself. The cost is one model's
        worth of bytes held by the worker between syncs (freed with the receiver).
        """
        kept = self.kept_buffers
        if bucket_index < len(kept) and kept[bucket_index].numel() >= num_bytes:
            return kept[bucket_index][:num_bytes]
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        if bucket_index < len(kept):
            kept[bucket_index] = buffer
        else:
            kept.append(buffer)
        return buffer
