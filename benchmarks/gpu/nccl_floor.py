"""The floor of an nccl push: bare broadcasts of its bytes over vLLM's ``PyNcclCommunicator``, no packing, no loading.

Used by ``nccl_push.py``: the trainer's side here, vLLM's worker's with :func:`receive_broadcasts`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

MASTER_ADDRESS = "127.0.0.1"


def free_port() -> int:
    with socket.create_server((MASTER_ADDRESS, 0)) as probe:
        return int(probe.getsockname()[1])


def timed_broadcasts(
    receive: Callable[[str, int, int, int], Any], num_bytes: int, rounds: int, device: torch.device
) -> list[float]:
    """Seconds of ``rounds`` broadcasts of ``num_bytes`` from this process (rank 0, on ``device``) to the one
    receiver that ``receive(address, port, num_bytes, rounds + 1)`` runs (on a thread here: it blocks until
    its side is done), after one untimed broadcast, in a group of their own."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    port = free_port()
    with ThreadPoolExecutor(max_workers=1) as pool:
        receiving = pool.submit(receive, MASTER_ADDRESS, port, num_bytes, rounds + 1)
        comm = stateless_init_process_group(MASTER_ADDRESS, port, 0, 2, device.index)
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        seconds = []
        for _ in range(rounds + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream(device))
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        receiving.result(timeout=300)
        comm.destroy()
    del buffer
    torch.cuda.empty_cache()
    return seconds[1:]


def receive_broadcasts(address: str, port: int, num_bytes: int, rounds: int, device: torch.device) -> list[float]:
    """Join the bare group of :func:`timed_broadcasts` as rank 1 on ``device`` and receive ``rounds`` broadcasts of
    ``num_bytes`` from rank 0; returns the seconds of each round as seen here."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    comm = stateless_init_process_group(address, port, 1, 2, device.index)
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    comm.destroy()
    del buffer
    torch.cuda.empty_cache()
    return seconds
