"""The gloo backend's wire (``backends/gloo/group.py``) and how it forms (``rendezvous.py``): real sockets on
loopback, in threads."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
import torch

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.backends.gloo.group import Wire
from lightning_vllm.backends.gloo.rendezvous import accept_workers, connect_to_trainer, listen
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError

GROUP = "lightning_vllm/test-group"


def worker_init(listener: socket.socket, world_size: int, bucket_size_bytes: int, timeout_seconds: float) -> Any:
    """What each of the ``world_size - 1`` workers joining the trainer on ``listener`` (loopback) is built from."""
    from lightning_vllm.backends.gloo.messages import GlooWeightTransferInitInfo

    return GlooWeightTransferInitInfo(
        master_address="127.0.0.1",
        master_port=listener.getsockname()[1],
        rank_offset=1,
        world_size=world_size,
        group_name=GROUP,
        bucket_size_bytes=bucket_size_bytes,
        timeout_seconds=timeout_seconds,
    )


def connected(num_workers: int, timeout: float = 10.0) -> tuple[Wire, list[Wire], int]:
    """A trainer's wire and ``num_workers`` workers' wires, joined over loopback."""
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    trainer = BackgroundCall(
        accept_workers, listener, GROUP, range(1, num_workers + 1), timeout, what="the workers to join"
    )
    workers = [
        BackgroundCall(connect_to_trainer, "127.0.0.1", port, GROUP, rank, timeout, what=f"worker {rank}")
        for rank in range(1, num_workers + 1)
    ]
    return trainer.result(timeout), [worker.result(timeout) for worker in workers], port


def test_every_worker_receives_every_broadcast_in_the_order_posted():
    trainer, workers, _ = connected(num_workers=2)
    try:
        sizes = [5, 0, 3 << 20, 17]
        sent = [torch.randint(0, 256, (size,), dtype=torch.uint8) for size in sizes]
        received = [[torch.empty(size, dtype=torch.uint8) for size in sizes] for _ in workers]
        receives = [wire.broadcast(buffer) for wire, buffers in zip(workers, received) for buffer in buffers]
        sends = [trainer.broadcast(tensor) for tensor in sent]
        for transfer in sends + receives:
            assert transfer.wait(10)
        for buffers in received:
            assert all(torch.equal(a, b) for a, b in zip(buffers, sent))
    finally:
        trainer.close()
        for wire in workers:
            wire.close()


def test_the_trainer_listens_on_the_address_and_port_it_was_given_and_workers_on_nothing():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        chosen = probe.getsockname()[1]
    listener = listen("127.0.0.1", chosen)
    assert listener.getsockname() == ("127.0.0.1", chosen)
    listener.close()
    with pytest.raises(WeightSyncError, match=r"Cannot listen on 192\.0\.2\.1:.*Pass a master_address of this machine"):
        listen("192.0.2.1", 0)  # TEST-NET-1: never an address of this machine


def test_connections_that_are_not_a_worker_of_the_group_are_turned_away():
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    trainer = BackgroundCall(accept_workers, listener, GROUP, range(1, 2), 10.0, what="the workers to join")
    for hello in (b"GET / HTTP/1.1\r\n\r\n", json.dumps({"group": "another", "rank": 1}).encode() + b"\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
            stranger.sendall(hello)
            assert stranger.recv(1) == b""  # closed, never told to go
    with pytest.raises(RuntimeError, match="closed the connection of worker rank 7"):
        connect_to_trainer("127.0.0.1", port, GROUP, 7, 5.0)  # not a rank of this group
    worker = connect_to_trainer("127.0.0.1", port, GROUP, 1, 5.0)
    wire = trainer.result(10)
    wire.close()
    worker.close()


def test_workers_that_never_come_end_in_a_timeout_that_counts_them():
    listener = listen("127.0.0.1", 0)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"Timed out after 0.3 s: 0 of 2 vLLM worker\(s\) joined"):
        accept_workers(listener, GROUP, range(1, 3), 0.3)
    assert time.monotonic() - start < 5
    listener.close()


def test_a_trainer_that_goes_away_mid_broadcast_fails_the_workers_receives_at_once():
    trainer, (worker,), _ = connected(num_workers=1)
    buffers = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(2)]
    receives = [worker.broadcast(buffer) for buffer in buffers]
    trainer.broadcast(torch.zeros(1 << 20, dtype=torch.uint8)).wait(10)
    trainer.close()  # what a killed trainer's kernel does to its sockets
    assert receives[0].wait(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the connection with the trainer at 127.0.0.1:.* broke"):
        receives[1].wait(10)
    assert time.monotonic() - start < 5
    worker.close()


def test_a_receive_that_gets_no_bytes_ends_within_its_timeout():
    trainer, (worker,), _ = connected(num_workers=1, timeout=0.5)
    receive = worker.broadcast(torch.empty(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="did not move within 0.2 s"):
        receive.wait(0.2)  # the caller's bound
    with pytest.raises(RuntimeError, match="broke"):
        receive.wait(5)  # the socket's own bound (0.5 s) ends it, and says so
    trainer.close()
    worker.close()


def test_only_flat_uint8_tensors_go_on_the_wire():
    trainer, (worker,), _ = connected(num_workers=1)
    with pytest.raises(ValueError, match="flat contiguous uint8 tensors, not torch.float32"):
        trainer.broadcast(torch.zeros(4))
    trainer.close()
    worker.close()


class JoinsThenFails:
    """An engine client whose worker connects, then whose init call fails (as a worker that
    crashed right after joining)."""

    def __init__(self) -> None:
        self.worker: Wire | None = None

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.worker = connect_to_trainer(info["master_address"], info["master_port"], info["group_name"], 1, 10.0)
        raise ValueError("the worker crashed after joining (test)")


def test_workers_that_joined_a_rendezvous_that_failed_are_let_go():
    from lightning_vllm.backends.gloo.messages import GlooTrainerInitInfo
    from lightning_vllm.backends.gloo.trainer import GlooTrainerWeightTransferEngine

    client = JoinsThenFails()
    with pytest.raises(ValueError, match="crashed after joining"):
        GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(world_size=2, timeout_seconds=10), client=client
        )
    assert client.worker is not None
    receive = client.worker.broadcast(torch.empty(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="broke"):  # the trainer closed its side: nothing waits on it
        receive.wait(5)
    client.worker.close()


def test_an_update_whose_trainer_stops_after_some_buckets_is_not_landed_not_even_in_part():
    """Receives that failed are complete too; an update whose first buckets landed and whose last
    ones failed must raise, never hand the landed buckets with the failed ones to the loader."""
    from lightning_vllm.backends.gloo.messages import Bucket, GlooWeightTransferUpdateInfo, TensorSpec
    from lightning_vllm.backends.gloo.receiver import GlooReceiver

    listener = listen("127.0.0.1", 0)
    init = worker_init(listener, world_size=2, bucket_size_bytes=1024, timeout_seconds=10.0)
    trainer = BackgroundCall(accept_workers, listener, GROUP, range(1, 2), 10.0, what="the worker to join")
    receiver = GlooReceiver(init, rank=1)
    wire = trainer.result(10)
    specs = [TensorSpec(name, torch.uint8, (1024,)) for name in "abc"]
    update = GlooWeightTransferUpdateInfo.from_buckets(specs, [Bucket(i, i + 1, 1024) for i in range(3)])
    posted = receiver.post_update(update)
    assert wire.broadcast(torch.ones(1024, dtype=torch.uint8)).wait(10)  # bucket "a" lands
    deadline = time.monotonic() + 10
    while not posted._posted[0][0][0].is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    wire.close()  # the trainer stops: the receives of "b" and "c" fail at once
    try:
        with pytest.raises(RuntimeError, match="did not arrive in full"):
            posted.wait()
    finally:
        receiver.close()
