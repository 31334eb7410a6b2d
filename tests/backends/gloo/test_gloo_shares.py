"""Every trainer rank sends its share (``backends/gloo/shares.py``): real sockets on loopback, in
threads, with a real worker receiver (``receiver.py``) putting the shares together."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_gloo_group import GROUP, worker_init

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.backends.gloo.group import SendWindow
from lightning_vllm.backends.gloo.messages import GlooWeightTransferUpdateInfo, TensorSpec, cut_into_buckets
from lightning_vllm.backends.gloo.receiver import GlooReceiver
from lightning_vllm.backends.gloo.rendezvous import accept_workers, listen
from lightning_vllm.backends.gloo.shares import post_piece, send_share
from lightning_vllm.weights.shares import chunk_counts

SENDERS_GROUP = "lightning_vllm/test-senders"
BUCKET = 1 << 20
TIMEOUT = 10.0

# Uneven rows (5 over 2 ranks), a rank with nothing (1 row), and one tensor larger than a bucket.
SHAPES = {"a": (5, 3), "b": (1, 4), "c": (4,), "big": (600, 1000)}


def full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def shares_of(tensor: torch.Tensor, world_size: int = 2) -> list[torch.Tensor]:
    """Each rank's share, by torch.chunk's rule on the rows (as FSDP2 holds them)."""
    per_row = tensor.numel() // tensor.shape[0]
    counts = [rows * per_row for rows in chunk_counts(tensor.shape[0], world_size)]
    flat, begin, shares = tensor.reshape(-1), 0, []
    for count in counts:
        shares.append(flat[begin : begin + count])
        begin += count
    return shares


def pushed(rank1_pieces, timeout: float = TIMEOUT):
    """Rank 0 and rank 1 send their shares of ``full_tensors()`` to two workers; what each worker's
    posted update gave (its tensors, or the error of its wait), and rank 1's outcome."""
    tensors = full_tensors()
    specs = [TensorSpec(name, torch.float32, tuple(tensor.shape)) for name, tensor in tensors.items()]
    rank0_listener, rank1_listener = listen("127.0.0.1", 0), listen("127.0.0.1", 0)
    init = worker_init(rank0_listener, world_size=3, bucket_size_bytes=BUCKET, timeout_seconds=timeout)
    rank0 = BackgroundCall(accept_workers, rank0_listener, GROUP, range(1, 3), timeout, what="the workers")
    joining = [BackgroundCall(GlooReceiver, init, rank, what=f"worker {rank}") for rank in (1, 2)]
    wire, workers = rank0.result(timeout), [worker.result(timeout) for worker in joining]
    pieces = [[share.numel() * 4 for share in shares_of(tensor)] for tensor in tensors.values()]
    update = GlooWeightTransferUpdateInfo.from_buckets(
        specs,
        cut_into_buckets([[spec] for spec in specs], BUCKET),
        pieces=pieces,
        senders=[{"address": "127.0.0.1", "port": rank1_listener.getsockname()[1]}],
        sender_group=SENDERS_GROUP,
    )
    rank1 = BackgroundCall(
        send_share, rank1_listener, SENDERS_GROUP, 2, rank1_pieces(tensors), BUCKET, timeout, what="rank 1's shares"
    )
    posting = [BackgroundCall(worker.post_update, update, what="the worker to post") for worker in workers]
    posted = [post.result(timeout) for post in posting]
    window = SendWindow(wire, BUCKET, timeout)
    for tensor in tensors.values():
        post_piece(window, shares_of(tensor)[0].view(torch.uint8), BUCKET)
    window.finish()
    try:
        rank1.result(timeout)
        rank1_error = None
    except Exception as error:  # noqa: BLE001  # what rank 1 would raise
        rank1_error = error
    landed = []
    for update in posted:
        try:
            landed.append({name: tensor for batch in update.wait() for name, tensor in batch})
        except RuntimeError as error:
            landed.append(error)
        assert update.senders == []  # the connections to rank 1 were for this update only
    wire.close()
    for worker in workers:
        worker.close()
    rank1_listener.close()
    return tensors, landed, rank1_error


def test_the_workers_put_each_ranks_share_in_its_place_and_get_every_full_tensor():
    tensors, landed, rank1_error = pushed(lambda tensors: (shares_of(t)[1].view(torch.uint8) for t in tensors.values()))
    assert rank1_error is None
    for received in landed:
        assert list(received) == list(tensors)
        assert all(torch.equal(received[name], tensor) for name, tensor in tensors.items())


def test_a_rank_that_fails_half_way_leaves_every_worker_with_nothing_to_load():
    def fails_after_one(tensors):
        shares = iter(tensors.values())
        yield shares_of(next(shares))[1].view(torch.uint8)
        raise RuntimeError("rank 1 lost its weights")

    _, landed, rank1_error = pushed(fails_after_one, timeout=5.0)
    assert isinstance(rank1_error, RuntimeError) and "rank 1 lost its weights" in str(rank1_error)
    for outcome in landed:
        assert isinstance(outcome, RuntimeError)
        assert re.search("did not arrive in full.*keeps its previous weights", str(outcome)), outcome


def test_pieces_must_add_up_to_each_tensor_and_name_every_rank():
    specs = [TensorSpec("a", torch.float32, (2, 2))]
    buckets = cut_into_buckets([specs], BUCKET)
    senders = [{"address": "127.0.0.1", "port": 1}]
    info = GlooWeightTransferUpdateInfo.from_buckets(specs, buckets, pieces=[[8, 8]], senders=senders, sender_group="g")
    assert GlooWeightTransferUpdateInfo(**dataclasses.asdict(info)).pieces == [[8, 8]]
    with pytest.raises(ValueError, match=r"pieces of 'a' are \[8, 4\].*adding up to its 16 bytes"):
        GlooWeightTransferUpdateInfo.from_buckets(specs, buckets, pieces=[[8, 4]], senders=senders, sender_group="g")
    with pytest.raises(ValueError, match=r"one count of bytes per trainer rank \(2\)"):
        GlooWeightTransferUpdateInfo.from_buckets(specs, buckets, pieces=[[16]], senders=senders, sender_group="g")
    with pytest.raises(ValueError, match="must name their sender_group"):
        GlooWeightTransferUpdateInfo.from_buckets(specs, buckets, pieces=[[8, 8]], senders=senders)


def test_only_a_backend_that_carries_shares_makes_a_ranks_end_of_them():
    from lightning_vllm.backends.registry import backend_named
    from lightning_vllm.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="backend='nccl' cannot carry"):
        backend_named("nccl").share_sender("127.0.0.1", 0)
    sender = backend_named("gloo").share_sender("127.0.0.1", 0)  # (rank k's listener, on loopback)
    try:
        endpoint = sender.endpoint()
        assert endpoint["address"] == "127.0.0.1" and endpoint["port"] > 0
    finally:
        sender.close()
