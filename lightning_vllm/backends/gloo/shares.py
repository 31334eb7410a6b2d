"""How a trainer rank's shares move when every trainer rank sends (``push_from="every_rank"``).

A *piece* is one rank's bytes of one tensor (``weights/shares.py``). It moves in slices of
at most ``bucket_size_bytes`` down the connection of every worker to that rank, in tensor
order; each worker posts the same slices into the right place of its receive buffers
(``receiver.py``), so the stream needs no framing. Rank 0's pieces go down the connections
made at init; every other rank accepts the workers anew on its own listener at each push,
as they name the push's group (``group.py``), and closes them once its pieces are out.
"""

from __future__ import annotations

import socket
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any, Protocol

import torch

from lightning_vllm._waits import BackgroundCall, wait_polling
from lightning_vllm.backends.gloo.buckets import TensorSpec, cut_into_buckets, piece_slices
from lightning_vllm.backends.gloo.group import Transfer, Wire, accept_workers
from lightning_vllm.backends.gloo.messages import GlooWeightTransferUpdateInfo
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError
from lightning_vllm.weights.shares import EveryRankSend

_WORK_POLL_SECONDS = 0.0005


def piece_bytes(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat share as the wire's bytes: its own memory when it is a contiguous CPU tensor of ``dtype``,
    a converted copy otherwise."""
    if piece.device.type != "cpu" or piece.dtype != dtype or not piece.is_contiguous():
        piece = piece.to(device="cpu", dtype=dtype).contiguous()
    return piece.reshape(-1).view(torch.uint8)


class BoundedPoster:
    """Posts slices on a wire with at most ``limit_bytes`` in flight; each wait bounded.

    Args:
        wire: the connections the slices go down.
        limit_bytes: the most bytes posted and not yet sent (the sender's extra memory).
        wait: waits for one transfer (``(transfer, bytes sent so far)``), raising if it failed.
    """

    def __init__(self, wire: Wire, limit_bytes: int, wait: Callable[[Transfer, int], None]) -> None:
        self.wire = wire
        self.limit_bytes = limit_bytes
        self.sent = 0
        self._wait = wait
        self._in_flight: deque[Transfer] = deque()
        self._in_flight_bytes = 0

    def post_piece(self, data: torch.Tensor, bucket_size_bytes: int) -> None:
        """Post one piece's bytes, slice by slice."""
        for begin, end in piece_slices(data.numel(), bucket_size_bytes):
            while self._in_flight and self._in_flight_bytes + end - begin > self.limit_bytes:
                self._wait_oldest()
            self._in_flight.append(self.wire.broadcast(data[begin:end]))
            self._in_flight_bytes += end - begin

    def finish(self) -> int:
        """Wait for every posted slice; the bytes sent."""
        while self._in_flight:
            self._wait_oldest()
        return self.sent

    def _wait_oldest(self) -> None:
        transfer = self._in_flight.popleft()
        self._wait(transfer, self.sent)
        self.sent += transfer.tensor.numel()
        self._in_flight_bytes -= transfer.tensor.numel()


def wait_for_transfer(transfer: Transfer, sent: int, timeout_seconds: float) -> None:
    """Wait (at most ``timeout_seconds``) for one slice of this rank's shares to go out.

    Raises:
        WeightSyncTimeoutError: it did not within the timeout.
        WeightSyncError: a worker's connection broke.
    """
    wait_polling(
        transfer.is_completed,
        timeout=timeout_seconds,
        interval=_WORK_POLL_SECONDS,
        timeout_error=lambda: WeightSyncTimeoutError(
            f"This rank's share of a push did not reach vLLM within {timeout_seconds:g} s after {sent} bytes."
        ),
    )
    try:
        transfer.wait()
    except RuntimeError as error:
        raise WeightSyncError(f"Sending this rank's share to vLLM failed after {sent} bytes: {error}.") from error


def send_share(
    listener: socket.socket,
    group: str,
    num_workers: int,
    pieces: Iterable[torch.Tensor],
    bucket_size_bytes: int,
    timeout_seconds: float,
) -> int:
    """Accept the ``num_workers`` workers naming ``group`` on ``listener`` (kept open), send them
    ``pieces`` (uint8, in the order the workers expect) and close their connections; the bytes sent.

    Raises:
        WeightSyncTimeoutError: the workers did not all connect, or a slice did not go out,
            within ``timeout_seconds``.
        WeightSyncError: a worker's connection broke.
    """
    wire = accept_workers(listener, group, range(1, num_workers + 1), timeout_seconds, keep_listener=True)
    try:
        poster = BoundedPoster(
            wire, bucket_size_bytes, lambda transfer, sent: wait_for_transfer(transfer, sent, timeout_seconds)
        )
        for data in pieces:
            poster.post_piece(data, bucket_size_bytes)
        return poster.finish()
    finally:
        wire.close()


class RankZeroTrainerEngine(Protocol):
    """What :func:`send_in_shares` uses of rank 0's trainer engine (``trainer.py``)."""

    bucket_size_bytes: int
    timeout_seconds: float

    def wait_for(self, work: Any, receive: BackgroundCall[None], sent: int) -> None:
        """Wait for one slice, failing early if the workers' call fails."""


def send_in_shares(
    sender: RankZeroTrainerEngine,
    wire: Wire,
    groups: Sequence[Sequence[TensorSpec]],
    tensors: Iterator[torch.Tensor],
    client: Any,
    every: EveryRankSend,
) -> None:
    """Rank 0's part of one update whose tensors every trainer rank sends a share of (``tensors``: rank
    0's shares, down ``wire``); returns once every rank has sent its shares, before the engine loads them.

    The other ranks are told the pass (the workers' group and the wire) before the workers are,
    and heard from after the bytes moved, whatever happened: a rank that failed fails the push on
    every rank, and the engine, which holds an incomplete update, loads nothing.
    """
    specs = [spec for group in groups for spec in group]
    group_name = f"lightning_vllm/{uuid.uuid4().hex}"  # lets the workers in at the other ranks, this push only
    every.begin_pass(group_name, len(wire.connections), [(spec.name, spec.dtype) for spec in specs])
    error: BaseException | None = None
    bucket_size_bytes, timeout_seconds = sender.bucket_size_bytes, sender.timeout_seconds
    try:
        pieces = [[count * spec.dtype.itemsize for count in every.shares.counts(spec.name)] for spec in specs]
        update_info = GlooWeightTransferUpdateInfo.from_buckets(
            specs,
            cut_into_buckets(groups, bucket_size_bytes),
            pieces=pieces,
            senders=every.senders,
            sender_group=group_name,
        )
        receive = BackgroundCall(client.update_weights, asdict(update_info), what="vLLM workers to load the weights")
        poster = BoundedPoster(wire, bucket_size_bytes, lambda work, sent: sender.wait_for(work, receive, sent))
        with torch.no_grad():
            for spec, piece, share in zip(specs, tensors, pieces):
                data = piece_bytes(piece, spec.dtype)
                if data.numel() != share[0]:
                    raise ValueError(f"Rank 0's share of {spec.name!r} is {data.numel()} bytes, not {share[0]}.")
                poster.post_piece(data, bucket_size_bytes)
        poster.finish()
        receive.result(timeout_seconds)
    except BaseException as caught:
        error = caught
    every.end_pass(error)  # raises if another rank failed
    if error is not None:
        raise error
