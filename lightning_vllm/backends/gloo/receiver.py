"""The receiving end of a sync: a worker's connection to the trainer and its receive buffers.

Kept apart from vLLM's worker engine class so that it holds no vLLM state: the
worker engine (``worker.py``) hands what lands here to the model's loader.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch

from lightning_vllm.backends.gloo.group import Transfer, Wire
from lightning_vllm.backends.gloo.messages import (
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    piece_slices,
    unpack_bucket,
)
from lightning_vllm.backends.gloo.rendezvous import connect_to_trainer

NamedTensors = list[tuple[str, torch.Tensor]]


class PostedUpdate:
    """The receives of one weight update, posted ahead: its bytes land while vLLM keeps serving.

    Nothing is loaded into the model until every byte has landed (:meth:`wait`), so a
    trainer that stops half way leaves the model as it was.
    """

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self.num_buffers = 0
        self.adapter: dict[str, Any] | None = None  # the LoRA adapter the update carries, if any
        self.fingerprinted = True  # the load fingerprints what vLLM's CPU build packs (the push is checked)
        self.senders: list[Wire] = []  # connections to the other trainer ranks, for this update only
        self._posted: list[tuple[list[Transfer], NamedTensors]] = []

    def add(self, works: list[Transfer], tensors: NamedTensors) -> None:
        """Count the broadcasts ``works`` that fill ``tensors`` as part of this update."""
        self._posted.append((works, tensors))

    def __len__(self) -> int:
        return len(self._posted)

    def arrived(self) -> Iterator[NamedTensors]:
        """Yield the named tensors in order, each once its bytes have landed (every wait bounded)."""
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        index = 0
        while index < len(self._posted):
            works, ready = self._posted[index]
            for work in works:
                work.wait(timeout)
            index += 1
            # What has landed already is loaded in one call; a receive that failed is not "landed" (it
            # is complete too), so its wait, next round, raises.
            while index < len(self._posted) and all(work.succeeded() for work in self._posted[index][0]):
                ready = ready + self._posted[index][1]
                index += 1
            yield ready

    def wait(self) -> list[NamedTensors]:
        """Every tensor of the update, once all have landed.

        Raises:
            RuntimeError: a receive failed or did not finish within the timeout (the
                trainer stopped or the network broke); nothing has been loaded.
        """
        try:
            return list(self.arrived())
        except RuntimeError as error:
            raise RuntimeError(
                f"The weight update did not arrive in full ({error}); the model keeps its previous weights. "
                "The trainer stopped or the network broke during the transfer."
            ) from error
        finally:
            self.close()

    def close(self) -> None:
        """Close the connections made for this update (receives still posted on them fail at once)."""
        for wire in self.senders:
            wire.close()
        self.senders = []


class GlooReceiver:
    """One worker's connection to the trainer (``group.py``).

    Args:
        init_info: the trainer's group, as sent at init.
        rank: this worker's rank in the group (the trainer is rank 0).

    Building it blocks until the trainer and every other worker have joined, or
    ``init_info.timeout_seconds`` pass.
    """

    def __init__(self, init_info: GlooWeightTransferInitInfo, rank: int) -> None:
        self.bucket_size_bytes = init_info.bucket_size_bytes
        self.timeout_seconds = init_info.timeout_seconds
        self.rank = rank
        self._group: Wire = connect_to_trainer(
            init_info.master_address,
            init_info.master_port,
            init_info.group_name,
            rank,
            init_info.timeout_seconds,
        )
        self.kept_buffers: list[torch.Tensor] = []

    def post_update(self, update_info: GlooWeightTransferUpdateInfo, into: PostedUpdate | None = None) -> PostedUpdate:
        """Post the receives of every bucket of ``update_info`` and return at once.

        The connection's own thread takes the bytes off the wire into the kept buffers while
        the caller goes on (vLLM keeps serving with the weights it has). A weight
        update sent in several ``update_weights`` calls posts each into the same
        :class:`PostedUpdate` (``into``), so its buckets get buffers of their own.
        """
        posted = into if into is not None else PostedUpdate(self.timeout_seconds)
        if update_info.adapter is not None:
            posted.adapter = update_info.adapter
        posted.fingerprinted = update_info.fingerprinted
        if update_info.pieces is not None:
            self._post_pieces(update_info, posted)
            return posted
        specs = update_info.specs()
        for bucket in update_info.buckets(specs):
            buffer = self._receive_buffer(posted.num_buffers, bucket.num_bytes)
            posted.num_buffers += 1
            for segment in update_info.segments(specs, bucket):
                slices = segment.slices(self.bucket_size_bytes)
                works = [self._group.broadcast(buffer[begin:end]) for begin, end in slices]
                data = buffer[segment.offset : segment.offset + segment.num_bytes]
                posted.add(works, unpack_bucket(data, specs[segment.start : segment.stop]))
        return posted

    def _post_pieces(self, update_info: GlooWeightTransferUpdateInfo, posted: PostedUpdate) -> None:
        """Post the receives of an update every trainer rank sends a share of: each tensor's pieces,
        in rank order, land end to end in its place (``backends/gloo/shares.py``).

        Joins each other trainer rank first (it accepts this update's workers), so it blocks until
        they have all joined, at most ``timeout_seconds`` each.
        """
        assert update_info.pieces is not None
        try:
            for sender in update_info.senders:
                posted.senders.append(
                    connect_to_trainer(
                        sender["address"],
                        int(sender["port"]),
                        update_info.sender_group,
                        self.rank,
                        self.timeout_seconds,
                    )
                )
        except BaseException:
            posted.close()
            raise
        wires = [self._group, *posted.senders]
        specs = update_info.specs()
        for bucket in update_info.buckets(specs):
            buffer = self._receive_buffer(posted.num_buffers, bucket.num_bytes)
            posted.num_buffers += 1
            works, offset = [], 0
            for pieces in update_info.pieces[bucket.start : bucket.stop]:
                for wire, num_bytes in zip(wires, pieces):
                    for begin, end in piece_slices(num_bytes, self.bucket_size_bytes):
                        works.append(wire.broadcast(buffer[offset + begin : offset + end]))
                    offset += num_bytes
            posted.add(works, unpack_bucket(buffer, specs[bucket.start : bucket.stop]))

    def close(self) -> None:
        """Close the connection; receives still posted fail at once."""
        self._group.close()

    def _receive_buffer(self, bucket_index: int, num_bytes: int) -> torch.Tensor:
        """Where bucket ``bucket_index`` of a sync lands: the same memory at every sync.

        Within a sync each bucket has its own buffer: the whole update lands before
        any of it is loaded, and layer-wise reload keeps the loaded views until their
        layer is complete. Between syncs nothing refers to them any more (every layer
        has been processed into vLLM's own tensors), so they are kept and reused: fresh
        memory would be page-faulted in at every sync, which measured slower than the
        copy itself. The cost is one model's
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
