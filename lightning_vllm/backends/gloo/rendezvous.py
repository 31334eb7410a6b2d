"""How a ``gloo`` group forms: the trainer listens, each vLLM worker connects out to it and says who it is.

The trainer listens on ``master_address:master_port``, the one port of a sync (a free one
when none is given). Each worker connects out to it, says which group and rank it is (a
line of JSON), and is answered once every worker has joined; from then on the connections are
the group's wire (``group.py``). The workers block inside ``init_weight_transfer_engine`` until
every one of them has joined, so the trainer tells them to join while it accepts them.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from dataclasses import asdict
from typing import Any

from lightning_vllm._waits import BackgroundCall, wait_polling
from lightning_vllm.backends.gloo.group import Connection, Wire
from lightning_vllm.backends.gloo.messages import GlooTrainerInitInfo, GlooWeightTransferInitInfo
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError

log = logging.getLogger(__name__)

_READY = b"\x01"  # the trainer's answer once every worker has joined
_MAX_HELLO_BYTES = 1024
_MAX_STRAY_CONNECTIONS = 64  # connections that are not a worker of this group, before giving up
_POLL_SECONDS = 0.05  # waiting for the workers to join polls, so that the engine's failure ends it early


def form_group(init_info: GlooTrainerInitInfo, client: Any) -> tuple[Wire, int]:
    """Listen, have the engine's workers join through ``client`` (``init_weight_transfer_engine``), and accept them:
    the group's wire and the port listened on.

    Raises:
        WeightSyncTimeoutError: not every worker joined within ``init_info.timeout_seconds`` (the error says what
            to check).
        WeightSyncError: the address cannot be listened on, or the workers could not join.
    """
    timeout = init_info.timeout_seconds
    listener = listen(init_info.master_address, init_info.master_port)
    port = int(listener.getsockname()[1])
    worker_info = GlooWeightTransferInitInfo(
        master_address=init_info.master_address,
        master_port=port,
        rank_offset=1,
        world_size=init_info.world_size,
        # Also what lets a worker in: only this engine's workers are told it.
        group_name=f"lightning_vllm/{uuid.uuid4().hex}",
        bucket_size_bytes=init_info.bucket_size_bytes,
        timeout_seconds=timeout,
    )
    trainer = BackgroundCall(
        accept_workers,
        listener,
        worker_info.group_name,
        range(1, init_info.world_size),
        timeout,
        what="the vLLM workers to connect",
    )
    workers = BackgroundCall(client.init_weight_transfer_engine, asdict(worker_info), what="vLLM workers to join")
    hint = (
        f"The trainer listened on {init_info.master_address}:{port}. Check that the engine was built with "
        "weight_transfer_config={'backend': 'gloo'}, that its workers can reach this address and port "
        "(firewall), and that vllm_tp_size matches the engine."
    )
    try:
        return _await_group(workers, trainer, timeout, hint), port
    except BaseException:
        listener.close()  # ends the accepting call too
        if trainer.done():
            _close_if_joined(trainer)
        raise


def _await_group(workers: BackgroundCall[None], trainer: BackgroundCall[Wire], timeout: float, hint: str) -> Wire:
    def joined() -> Wire:
        try:
            return trainer.result(0)
        except WeightSyncTimeoutError as error:
            raise WeightSyncTimeoutError(f"{error} {hint}") from error
        except OSError as error:
            raise WeightSyncError(f"The workers could not join: {error}. {hint}") from error

    def either_failed() -> None:
        if workers.done():
            workers.result(0)  # raises the engine's error, if it failed
        if trainer.done():
            joined()  # raises, if accepting the workers failed

    # The accepting side times out on its own after ``timeout``, saying how many workers joined; this wait
    # outlasts it a little, so that on a busy machine its error, not this one, is what nobody joining raises.
    backstop = timeout + 1.0
    wait_polling(
        lambda: workers.done() and trainer.done(),
        timeout=backstop,
        interval=_POLL_SECONDS,
        check=either_failed,
        timeout_error=lambda: WeightSyncTimeoutError(
            f"Timed out after {backstop:g} s waiting for the vLLM workers to join. {hint}"
        ),
    )
    workers.result(0)
    return joined()


def _close_if_joined(trainer: BackgroundCall[Wire]) -> None:
    """Close the connections of workers that joined although the rendezvous failed (their engine's call did)."""
    try:
        wire = trainer.result(0)
    except Exception:  # noqa: BLE001  # accepting failed too: nothing to close
        return
    wire.close()


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
    connections = [Connection(_tuned(joined[rank]), f"worker rank {rank}", receives=False) for rank in ranks]
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
    return Wire([Connection(_tuned(sock), f"the trainer at {address}:{port}", receives=True)])


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
