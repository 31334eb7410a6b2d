"""Probe: what a receiving NCCL rank sees when its sender fails half way, on one GPU (each rank its own NCCL host).

Two processes on ``cuda:0`` with distinct ``NCCL_HOSTID`` values join vLLM's ``PyNcclCommunicator`` (as vLLM's NCCL
weight-transfer engine does). The receiver posts four 64 MiB broadcasts; the sender sends one, then fails: it
aborts its communicator (what ``PyNcclCommunicator.destroy`` does, as the trainer's engine shutdown does), or is
SIGKILLed. The receiver reports whether its stream ended by itself, when ``ncclCommGetAsyncError`` first said an
error, and whether its own ``ncclCommAbort`` then ended the stream.

On the GPU host: ``source .gpu-carry/setup.sh && python3 tests/gpu/nccl/peer_failure_probe.py``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time

CHUNK = 16 << 20  # float32 elements: 64 MiB
SENT = 4


def join(rank: int, port: int):
    os.environ["NCCL_HOSTID"] = f"probe-party-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    torch.cuda.set_device(0)
    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=2)
    return PyNcclCommunicator(group, device=torch.device("cuda", 0))


def async_error(comm) -> int:
    result = ctypes.c_int(0)
    function = comm.nccl.lib.ncclCommGetAsyncError
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    function(comm.comm, ctypes.byref(result))
    return int(result.value)


def sender(port: int, how: str) -> None:
    import torch

    comm = join(0, port)
    x = torch.ones(CHUNK, device="cuda")
    comm.broadcast(x, src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    time.sleep(1.0)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    comm.destroy()  # ncclCommAbort, as vLLM's trainer engine's shutdown
    time.sleep(30)


def receiver(port: int, queue) -> None:
    import torch

    comm = join(1, port)
    stream = torch.cuda.Stream()
    buffers = [torch.zeros(CHUNK, device="cuda") for _ in range(SENT)]
    for buffer in buffers:
        comm.broadcast(buffer, src=0, stream=stream)
    done = threading.Event()
    threading.Thread(target=lambda: (stream.synchronize(), done.set()), daemon=True).start()
    started, first_error, ended_by_itself = time.monotonic(), None, False
    while time.monotonic() - started < 25:
        if done.is_set():
            ended_by_itself = True
            break
        code = async_error(comm)
        if code not in (0, 7) and first_error is None:  # 7: ncclInProgress
            first_error = (round(time.monotonic() - started, 2), code)
            break
        time.sleep(0.1)
    record = {"ended_by_itself": ended_by_itself, "first_async_error": first_error}
    if not ended_by_itself:
        aborted_at = time.monotonic()
        threading.Thread(target=lambda: comm.nccl.ncclCommAbort(comm.comm), daemon=True).start()
        record["stream_ended_after_abort"] = done.wait(20)
        record["abort_seconds"] = round(time.monotonic() - aborted_at, 2)
    record["first_received"] = float(buffers[0][0].item()) if record.get("stream_ended_after_abort", True) else None
    queue.put(record)
    queue.close()
    queue.join_thread()
    os._exit(0)  # the aborted communicator's teardown is not what is probed


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    for how in sys.argv[1:] or ["abort", "kill"]:
        queue, port = context.Queue(), free_port()
        parties = [
            context.Process(target=sender, args=(port, how)),
            context.Process(target=receiver, args=(port, queue)),
        ]
        for party in parties:
            party.start()
        try:
            print(f"sender {how}s half way: receiver saw", queue.get(timeout=90), flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"sender {how}s half way: no answer from the receiver ({error!r})", flush=True)
        for party in parties:
            party.kill()
            party.join(10)
