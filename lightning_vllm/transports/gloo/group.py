"""The gloo group a sync runs on: the rendezvous store, the group, and its broadcasts.

The trainer (rank 0) hosts a ``torch.distributed.TCPStore``; the trainer and every
vLLM worker build a ``ProcessGroupGloo`` of their own over it. The global default
process group, which Lightning owns under DDP, is never touched.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from lightning_vllm.errors import WeightSyncError


def host_store(address: str, port: int, world_size: int, timeout_seconds: float) -> tuple[TCPStore, int]:
    """The trainer's rendezvous store, listening on ``address`` only; returns it and its port.

    The socket is bound here and handed to the store, so it listens on this address
    alone, and port 0 picks a free port with no window in which another process
    could take it.

    Raises:
        WeightSyncError: the address or port cannot be listened on.
    """
    try:
        listener = socket.create_server((address, port))
    except OSError as error:
        raise WeightSyncError(
            f"Cannot listen on {address}:{port} for the weight sync rendezvous ({error}). Pass a master_address "
            "of this machine and a free master_port (or None to pick one)."
        ) from error
    bound_port = int(listener.getsockname()[1])
    store = TCPStore(
        address,
        bound_port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_seconds),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, bound_port


def join_store(address: str, port: int, world_size: int, timeout_seconds: float) -> TCPStore:
    """A worker's client of the trainer's store; blocks until connected or ``timeout_seconds`` pass."""
    return TCPStore(address, port, world_size, False, datetime.timedelta(seconds=timeout_seconds))


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that routes to ``host``.

    A UDP ``connect`` sends no packet; it only asks the kernel which interface it
    would use. Workers bind their gloo endpoint there, so a worker on the trainer's
    machine stays on loopback when the trainer is on loopback.

    Example::

        >>> local_address_towards("127.0.0.1")
        '127.0.0.1'
    """
    family, _, _, _, address = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def new_gloo_group(
    store: TCPStore, group_name: str, *, rank: int, world_size: int, address: str, timeout_seconds: float
) -> ProcessGroupGloo:
    """A gloo group of its own over ``store``, its endpoint bound to ``address``.

    Blocks until all ``world_size`` ranks have joined or ``timeout_seconds`` pass.
    """
    # torch's stubs omit the gloo options, the only way to bind the endpoint to one address.
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = datetime.timedelta(seconds=timeout_seconds)
    return ProcessGroupGloo(PrefixStore(group_name, store), rank, world_size, options)


def post_broadcast(group: ProcessGroupGloo, tensor: torch.Tensor) -> Any:
    """Start broadcasting a contiguous CPU tensor from rank 0; returns the ``Work`` to wait on.

    gloo runs posted collectives on its own threads, in the order they were posted on
    each rank, so both sides post the same sequence of sizes.
    """
    return group.broadcast(tensor, 0)  # type: ignore[attr-defined]  # torch's stubs omit it
