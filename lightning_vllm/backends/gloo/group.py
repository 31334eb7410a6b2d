"""How a sync's bytes move: one TCP connection from each vLLM worker to the trainer (``rendezvous.py`` forms them).

The trainer writes every broadcast to each worker's connection in the order posted, and each worker
reads them, in the same order, into the buffers it posted. Both sides post the same
sequence of sizes (the update's bucket layout), so the stream carries raw bytes and no framing.
The trainer bounds what it has posted and not seen finish (:class:`SendWindow`), and the copies those
broadcasts read live in one bucket of staging memory (:class:`StagingRing`).

Why not gloo, whose name the backend keeps: gloo's TCP device listens on a port the
kernel picks, in every process, and neither gloo nor torch can be given one, so no
firewall rule could name it. Here the trainer listens on the port the user chose and the
workers listen on nothing. Nothing read from the network is unpickled.
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lightning_vllm._waits import BackgroundCall, wait_polling
from lightning_vllm.backends.gloo.messages import TensorSpec
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError

# Waiting on a broadcast polls, so that a failure of the workers' side ends it early.
_POLL_SECONDS = 0.0005


class Transfer:
    """One posted broadcast (trainer) or receive (worker): complete once its bytes have gone
    out on, or come in from, every connection it uses, or once one of them failed.

    The same surface as a torch ``Work``: :meth:`is_completed` and :meth:`wait`.
    """

    def __init__(self, tensor: torch.Tensor, num_connections: int) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"The wire moves flat contiguous uint8 tensors, not {tensor.dtype} {tuple(tensor.shape)}.")
        self.tensor = tensor  # kept alive until its bytes have moved
        self._left = num_connections
        self._error: str | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        if num_connections == 0:
            self._done.set()

    def finish(self, error: str | None = None) -> None:
        """One connection is done with it (``error``: how it failed)."""
        with self._lock:
            self._left -= 1
            if error is not None and self._error is None:
                self._error = error
            if self._left <= 0 or self._error is not None:
                self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def succeeded(self) -> bool:
        """Complete, with every byte moved (a failed transfer is complete too)."""
        return self._done.is_set() and self._error is None

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until complete (at most ``timeout``).

        Raises:
            RuntimeError: a connection failed, or ``timeout`` passed first.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._done.wait(seconds):
            raise RuntimeError(f"{self.tensor.numel()} bytes did not move within {seconds:g} s")
        if self._error is not None:
            raise RuntimeError(self._error)
        return True


class Connection:
    """One peer's socket and the thread that moves the transfers posted to it, in order."""

    def __init__(self, sock: socket.socket, peer: str, *, receives: bool) -> None:
        self.sock, self.peer, self.receives = sock, peer, receives
        self.failure: str | None = None
        self._posted: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lightning-vllm wire {peer}", daemon=True)
        self._thread.start()

    def post(self, transfer: Transfer) -> None:
        if self.failure is not None:
            transfer.finish(self.failure)
        else:
            self._posted.put(transfer)

    def _run(self) -> None:
        while (transfer := self._posted.get()) is not None:
            if self.failure is not None:
                transfer.finish(self.failure)
                continue
            try:
                data = transfer.tensor.detach().numpy().data  # the tensor's own memory, no copy
                if self.receives:
                    _receive_into(self.sock, data)
                else:
                    self.sock.sendall(data)
                transfer.finish()
            except (OSError, ValueError) as error:  # a broken or closed connection, or its timeout
                self.failure = f"the connection with {self.peer} broke ({type(error).__name__}: {error})"
                transfer.finish(self.failure)

    def close(self) -> None:
        """Break the connection; transfers still posted fail at once."""
        self.failure = self.failure or f"the connection with {self.peer} was closed"
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # ends a blocked send or receive
        except OSError:
            pass
        self.sock.close()
        self._posted.put(None)


def _receive_into(sock: socket.socket, data: memoryview) -> None:
    received = 0
    while received < len(data):
        count = sock.recv_into(data[received:])
        if count == 0:
            raise ConnectionError(f"the peer closed the connection after {received} of {len(data)} bytes")
        received += count


class Wire:
    """The connections of one side of a sync: the trainer's to every worker, or a worker's to
    the trainer. Every wait is bounded: each socket operation by ``timeout_seconds``."""

    def __init__(self, connections: list[Connection], listener: socket.socket | None = None) -> None:
        self.connections = connections
        self._listener = listener  # the trainer's, open while the group is

    def broadcast(self, tensor: torch.Tensor) -> Transfer:
        """Post ``tensor``: sent to every worker (trainer) or received into it (worker)."""
        transfer = Transfer(tensor, len(self.connections))
        for connection in self.connections:
            connection.post(transfer)
        return transfer

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        if self._listener is not None:
            self._listener.close()


class SendWindow:
    """The broadcasts a sender posted down a wire and has not seen finish: at most ``limit_bytes`` of them, so that
    the memory they read (a staging region, a gathered layer, a share) stays bounded. The trainer's update
    (``trainer.py``) and each rank's shares when every rank sends (``shares.py``) go through one.

    Args:
        wire: the connections the broadcasts go down.
        limit_bytes: the most bytes posted and not yet sent.
        timeout_seconds: how long one broadcast may take.
        what: what is sent, as errors name it (``"A broadcast to vLLM"``).
        receiving: the workers' call that receives the broadcasts (``update_weights``); a wait ends early, with its
            error, once it failed.

    Example::

        >>> window = SendWindow(Wire([]), limit_bytes=8, timeout_seconds=1.0)
        >>> _ = window.post(torch.zeros(8, dtype=torch.uint8)); _ = window.post(torch.zeros(4, dtype=torch.uint8))
        >>> window.finish()  # (no connection: each is complete as posted; the first was waited for to post the second)
        12
    """

    def __init__(
        self,
        wire: Wire,
        limit_bytes: int,
        timeout_seconds: float,
        what: str = "A broadcast to vLLM",
        receiving: BackgroundCall[None] | None = None,
    ) -> None:
        self.wire, self.limit_bytes, self.timeout_seconds, self.what, self.receiving = (
            wire, limit_bytes, timeout_seconds, what, receiving
        )  # fmt: skip
        self.sent = 0  # the bytes of the broadcasts waited for
        self._posted: deque[Transfer] = deque()
        self._posted_bytes = 0

    def post(self, data: torch.Tensor) -> Transfer:
        """Post ``data`` (flat ``uint8``), once the broadcasts in flight leave room for it."""
        while self._posted and self._posted_bytes + data.numel() > self.limit_bytes:
            self.wait_oldest()
        transfer = self.wire.broadcast(data)
        self._posted.append(transfer)
        self._posted_bytes += data.numel()
        return transfer

    def wait_oldest(self) -> None:
        """Wait for the oldest broadcast in flight (at most ``timeout_seconds``).

        Raises:
            WeightSyncTimeoutError: it did not finish in time.
            WeightSyncError: a connection broke (or the receiving call failed first: its error).
        """
        transfer = self._posted.popleft()
        wait_for_transfer(transfer, self.sent, self.timeout_seconds, self.what, self.raise_if_receiving_failed)
        self.sent += transfer.tensor.numel()
        self._posted_bytes -= transfer.tensor.numel()

    def raise_if_receiving_failed(self) -> None:
        """Raise the receiving call's error if it failed."""
        if self.receiving is not None and self.receiving.done():
            self.receiving.result(0)

    def finish(self) -> int:
        """Wait for every broadcast posted; the bytes sent."""
        while self._posted:
            self.wait_oldest()
        return self.sent


def wait_for_transfer(
    transfer: Transfer, sent: int, timeout_seconds: float, what: str, check: Callable[[], None] = lambda: None
) -> None:
    """Wait at most ``timeout_seconds`` for ``transfer``, ``sent`` bytes into what is sent; ``check`` may raise first.

    Raises:
        WeightSyncTimeoutError: it did not finish in time.
        WeightSyncError: a connection broke.
    """
    stopped = "The engine may have stopped; re-initialise the updater (init) once it is back."
    wait_polling(
        transfer.is_completed,
        timeout=timeout_seconds,
        interval=_POLL_SECONDS,
        check=check,
        timeout_error=lambda: WeightSyncTimeoutError(
            f"{what} did not finish within {timeout_seconds:g} s after {sent} bytes. {stopped}"
        ),
    )
    try:
        transfer.wait()
    except RuntimeError as error:
        check()
        raise WeightSyncError(f"{what} failed after {sent} bytes: {error}. {stopped}") from error


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
