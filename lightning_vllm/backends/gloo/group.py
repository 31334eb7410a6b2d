"""How a sync's bytes move: one TCP connection from each vLLM worker to the trainer.

The trainer listens on ``master_address:master_port``, the one port of a sync (a free one
when none is given). Each worker connects out to it, says which group and rank it is (a
line of JSON), and is answered once every worker has joined. From then on the trainer
writes every broadcast to each worker's connection in the order posted, and each worker
reads them, in the same order, into the buffers it posted. Both sides post the same
sequence of sizes (the update's bucket layout), so the stream carries raw bytes and no framing.

Why not gloo, whose name the backend keeps: gloo's TCP device listens on a port the
kernel picks, in every process, and neither gloo nor torch can be given one, so no
firewall rule could name it. Here the trainer listens on the port the user chose and the
workers listen on nothing. Nothing read from the network is unpickled.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from lightning_vllm._waits import wait_polling
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError

log = logging.getLogger(__name__)

_READY = b"\x01"  # the trainer's answer once every worker has joined
_MAX_HELLO_BYTES = 1024
_MAX_STRAY_CONNECTIONS = 64  # connections that are not a worker of this group, before giving up
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


class _Connection:
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

    def __init__(self, connections: list[_Connection], listener: socket.socket | None = None) -> None:
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


def listen(address: str, port: int) -> socket.socket:
    """The trainer's listening socket on ``address`` only (``port`` 0: a free one, with no
    window in which another process could take it).

    Raises:
        WeightSyncError: the address or port cannot be listened on.
    """
    try:
        return socket.create_server((address, port))
    except OSError as error:
        raise WeightSyncError(
            f"Cannot listen on {address}:{port} for the weight sync ({error}). Pass a master_address "
            "of this machine and a free master_port (or None to pick one)."
        ) from error


def accept_workers(
    listener: socket.socket, group_name: str, ranks: range, timeout_seconds: float, *, keep_listener: bool = False
) -> Wire:
    """Accept one connection from each of ``ranks`` that names ``group_name``, then tell each to go.

    Connections that are not a worker of this group (another group's, a rank already
    joined, a port scanner) are closed and logged; at most 64 of them are read. The
    returned wire closes ``listener`` with its connections, unless ``keep_listener``
    (a trainer rank that accepts the workers anew at each push).

    Raises:
        WeightSyncTimeoutError: not every worker joined within ``timeout_seconds``.
    """
    deadline = time.monotonic() + timeout_seconds
    joined: dict[int, socket.socket] = {}
    try:
        for _ in range(len(ranks) + _MAX_STRAY_CONNECTIONS):
            if len(joined) == len(ranks):
                break
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                break
            rank = _read_hello(sock, group_name, ranks, deadline, peer)
            if rank is None or rank in joined:
                sock.close()
                continue
            joined[rank] = sock
        if len(joined) != len(ranks):
            raise WeightSyncTimeoutError(
                f"Timed out after {timeout_seconds:g} s: {len(joined)} of {len(ranks)} vLLM worker(s) joined."
            )
        for sock in joined.values():
            sock.settimeout(timeout_seconds)
            sock.sendall(_READY)
    except BaseException:
        for sock in joined.values():
            sock.close()
        raise
    connections = [_Connection(_tuned(joined[rank]), f"worker rank {rank}", receives=False) for rank in ranks]
    return Wire(connections, None if keep_listener else listener)


def _read_hello(sock: socket.socket, group_name: str, ranks: range, deadline: float, peer: object) -> int | None:
    """The rank a connecting worker of ``group_name`` names, or None for anyone else."""
    sock.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.001))
    line = b""
    try:
        while not line.endswith(b"\n") and len(line) < _MAX_HELLO_BYTES:
            chunk = sock.recv(_MAX_HELLO_BYTES - len(line))
            if not chunk:
                break
            line += chunk
        hello = json.loads(line)
        if hello["group"] == group_name and hello["rank"] in ranks:
            return int(hello["rank"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.warning("Closed a connection to the weight sync's port from %s: not a worker of this sync.", peer)
    return None


def connect_to_trainer(address: str, port: int, group_name: str, rank: int, timeout_seconds: float) -> Wire:
    """A worker's connection to the trainer; returns once every worker has joined.

    Raises:
        RuntimeError: the trainer cannot be reached, refused this worker, or did not answer
            within ``timeout_seconds``.
    """
    try:
        sock = socket.create_connection((address, port), timeout=timeout_seconds)
    except OSError as error:
        raise RuntimeError(
            f"Cannot reach the trainer at {address}:{port} ({error}); check that this host can reach "
            "the trainer's master_address and master_port."
        ) from error
    try:
        sock.sendall(json.dumps({"group": group_name, "rank": rank}).encode() + b"\n")
        if sock.recv(1) != _READY:
            raise RuntimeError(f"The trainer at {address}:{port} closed the connection of worker rank {rank}.")
    except OSError as error:
        sock.close()
        raise RuntimeError(
            f"The trainer at {address}:{port} did not let worker rank {rank} join within {timeout_seconds:g} s "
            f"({error})."
        ) from error
    except BaseException:
        sock.close()
        raise
    return Wire([_Connection(_tuned(sock), f"the trainer at {address}:{port}", receives=True)])


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class InFlight:
    """The broadcasts a sender posted down a wire and has not seen finish: at most ``limit_bytes`` of them, so that
    the memory they read (a staging region, a gathered layer, a share) stays bounded. The trainer's update
    (``trainer.py``) and each rank's shares when every rank sends (``shares.py``) go through one.

    Args:
        wire: the connections the broadcasts go down.
        limit_bytes: the most bytes posted and not yet sent.
        timeout_seconds: how long one broadcast may take.
        what: what is sent, as errors name it (``"A broadcast to vLLM"``).
        check: raises once the receiving side is known to have failed (asked while waiting).

    Example::

        >>> window = InFlight(Wire([]), limit_bytes=8, timeout_seconds=1.0)
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
        check: Callable[[], None] = lambda: None,
    ) -> None:
        self.wire, self.limit_bytes, self.timeout_seconds, self.what, self.check = (
            wire, limit_bytes, timeout_seconds, what, check
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
            WeightSyncError: a connection broke (or ``check`` raised its own error first).
        """
        transfer = self._posted.popleft()
        wait_for_transfer(transfer, self.sent, self.timeout_seconds, self.what, self.check)
        self.sent += transfer.tensor.numel()
        self._posted_bytes -= transfer.tensor.numel()

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
