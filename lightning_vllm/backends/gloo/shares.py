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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any, Protocol

import torch

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.backends.gloo.group import SendWindow, Wire
from lightning_vllm.backends.gloo.messages import (
    GlooWeightTransferUpdateInfo,
    TensorSpec,
    cut_into_buckets,
    dtype_from_name,
    dtype_name,
    piece_slices,
)
from lightning_vllm.backends.gloo.rendezvous import accept_workers, listen
from lightning_vllm.weights.shares import EveryRankSend, RankShares, ShareSender


def piece_bytes(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat share as the wire's bytes: its own memory when it is a contiguous CPU tensor of ``dtype``,
    a converted copy otherwise."""
    if piece.device.type != "cpu" or piece.dtype != dtype or not piece.is_contiguous():
        piece = piece.to(device="cpu", dtype=dtype).contiguous()
    return piece.reshape(-1).view(torch.uint8)


def post_piece(window: SendWindow, data: torch.Tensor, bucket_size_bytes: int) -> None:
    """Post one piece's bytes through ``window``, slice by slice, as the workers post their receives."""
    for begin, end in piece_slices(data.numel(), bucket_size_bytes):
        window.post(data[begin:end])


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
        window = SendWindow(wire, bucket_size_bytes, timeout_seconds, what="This rank's share of a push")
        for data in pieces:
            post_piece(window, data, bucket_size_bytes)
        return window.finish()
    finally:
        wire.close()


class RankZeroTrainerEngine(Protocol):
    """What :func:`send_in_shares` uses of rank 0's trainer engine (``trainer.py``)."""

    bucket_size_bytes: int
    timeout_seconds: float


def send_in_shares(
    sender: RankZeroTrainerEngine,
    wire: Wire,
    groups: Sequence[Sequence[TensorSpec]],
    tensors: Iterator[torch.Tensor],
    client: Any,
    every: EveryRankSend,
    fingerprinted: bool = True,
) -> None:
    """Rank 0's part of one update whose tensors every trainer rank sends a share of (``tensors``: rank
    0's shares, down ``wire``); returns once every rank has sent its shares, before the engine loads them.

    The other ranks are told the pass (the workers' group and the wire) before the workers are,
    and heard from after the bytes moved, whatever happened: a rank that failed fails the push on
    every rank, and the engine, which holds an incomplete update, loads nothing.
    """
    specs = [spec for group in groups for spec in group]
    group_name = f"lightning_vllm/{uuid.uuid4().hex}"  # lets the workers in at the other ranks, this push only
    named = [[spec.name, dtype_name(spec.dtype)] for spec in specs]
    every.begin_pass({"group": group_name, "workers": len(wire.connections), "tensors": named})
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
            fingerprinted=fingerprinted,
        )
        receive = BackgroundCall(client.update_weights, asdict(update_info), what="vLLM workers to load the weights")
        window = SendWindow(wire, bucket_size_bytes, timeout_seconds, receiving=receive)
        with torch.no_grad():
            for spec, piece, share in zip(specs, tensors, pieces):
                data = piece_bytes(piece, spec.dtype)
                if data.numel() != share[0]:
                    raise ValueError(f"Rank 0's share of {spec.name!r} is {data.numel()} bytes, not {share[0]}.")
                post_piece(window, data, bucket_size_bytes)
        window.finish()
        receive.result(timeout_seconds)
    except BaseException as caught:
        error = caught
    every.end_pass(error)  # raises if another rank failed
    if error is not None:
        raise error


class GlooShareSender(ShareSender):
    """A trainer rank other than 0's end over gloo: a listener of its own, kept across pushes, which the workers
    connect to at each pass (naming its group), and its shares sent down their connections, closed after.

    Args:
        address: where it listens (``every_rank.send_address``).
        port: the port (0: one the kernel picks).
    """

    def __init__(self, address: str, port: int) -> None:
        self.listener = listen(address, port)

    def endpoint(self) -> dict[str, Any]:
        address, port = self.listener.getsockname()[:2]
        return {"address": address, "port": port}

    def tensors_of(self, announced: dict[str, Any]) -> list[tuple[str, torch.dtype]]:
        return [(name, dtype_from_name(dtype)) for name, dtype in announced["tensors"]]

    def send_pass(self, announced: dict[str, Any], shares: RankShares, bucket_size_bytes: int, timeout: float) -> int:
        pieces = _pieces(shares, self.tensors_of(announced))
        workers = int(announced["workers"])
        return send_share(self.listener, announced["group"], workers, pieces, bucket_size_bytes, timeout)

    def close(self) -> None:
        self.listener.close()


def _pieces(shares: RankShares, sent: Sequence[tuple[str, torch.dtype]]) -> Iterator[torch.Tensor]:
    """This rank's shares of the tensors ``sent`` names, in its order, as the bytes sent."""
    tensors = shares.iter_full()
    for name, dtype in sent:
        for have, piece in tensors:
            if have == name:
                yield piece_bytes(piece, dtype)
                break
        else:
            raise ValueError(f"Rank {shares.rank} has no tensor {name!r} to send; its policy differs from rank 0's.")
