"""The gloo backend's messages and checks (the transfer itself runs in the end-to-end tests)."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.backends.gloo.group import Connection, SendWindow, Wire
from lightning_vllm.backends.gloo.messages import (
    Bucket,
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    TensorSpec,
    dtype_from_name,
)
from lightning_vllm.backends.gloo.rendezvous import _await_group
from lightning_vllm.backends.gloo.trainer import GlooTrainerWeightTransferEngine
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError


def test_update_info_round_trips_through_plain_data():
    specs = [TensorSpec("a", torch.bfloat16, (2, 3)), TensorSpec("b", torch.float32, (4,))]
    info = GlooWeightTransferUpdateInfo.from_buckets(specs, [Bucket(0, 1, 12), Bucket(1, 2, 16)])
    payload = dataclasses.asdict(info)  # what crosses the process boundary: lists, strings, ints
    assert payload == {
        "names": ["a", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "bucket_ends": [1, 2],
        "segment_ends": [1, 2],
        "adapter": None,
        "pieces": None,  # (every trainer rank sends a share: tests/backends/gloo/test_gloo_shares.py)
        "senders": [],
        "sender_group": "",
        "fingerprinted": True,  # (the workers fingerprint what vLLM packs: the push is checked)
    }
    received = GlooWeightTransferUpdateInfo(**payload)
    assert received.specs() == specs
    assert received.buckets(specs) == [Bucket(0, 1, 12), Bucket(1, 2, 16)]


def test_update_info_rejects_inconsistent_plans():
    with pytest.raises(ValueError, match="one entry per tensor"):
        GlooWeightTransferUpdateInfo(names=["a"], dtype_names=[], shapes=[[1]], bucket_ends=[1], segment_ends=[1])
    two = dict(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1]] * 2)
    with pytest.raises(ValueError, match="must rise strictly and end at 2"):
        GlooWeightTransferUpdateInfo(**two, bucket_ends=[1], segment_ends=[1])
    with pytest.raises(ValueError, match="include every bucket end"):
        GlooWeightTransferUpdateInfo(**two, bucket_ends=[1, 2], segment_ends=[2])
    with pytest.raises(ValueError, match="must end at 2"):
        GlooWeightTransferUpdateInfo(**two, bucket_ends=[], segment_ends=[1])


def test_dtype_names_are_never_evaluated_as_arbitrary_attributes():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="Unknown dtype name 'tensor'"):
        dtype_from_name("tensor")


@pytest.mark.parametrize("size", [0, -8, 12])
def test_bucket_size_must_be_a_positive_multiple_of_eight(size):
    with pytest.raises(ValueError, match=f"bucket_size_bytes={size}"):
        GlooTrainerInitInfo(bucket_size_bytes=size)
    with pytest.raises(ValueError, match=f"bucket_size_bytes={size}"):
        GlooWeightTransferInitInfo(
            master_address="127.0.0.1",
            master_port=1,
            rank_offset=1,
            world_size=2,
            group_name="g",
            bucket_size_bytes=size,
        )


def test_a_broadcast_that_never_finishes_ends_in_a_timeout_error_that_says_so():
    workers_loading = BackgroundCall(time.sleep, 5, what="vLLM workers to load the weights")
    trainer_end, worker_end = socket.socketpair()  # a worker that never reads: a large broadcast never finishes
    wire = Wire([Connection(trainer_end, "worker 1", receives=False)])
    window = SendWindow(wire, 1 << 20, timeout_seconds=0.2, receiving=workers_loading)
    window.post(torch.zeros(32 << 20, dtype=torch.uint8))
    with pytest.raises(WeightSyncTimeoutError, match="did not finish within 0.2 s after 0 bytes"):
        window.finish()
    wire.close()
    worker_end.close()


class RecordingClient:
    """A weight-sync client that records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name)


def test_an_engine_that_is_not_connected_never_starts_an_update():
    from helpers import tiny_qwen2

    from lightning_vllm.weights import weights_from

    client = RecordingClient()
    engine = GlooTrainerWeightTransferEngine(client=client, source=weights_from(tiny_qwen2()))
    with pytest.raises(RuntimeError, match="not connected: build it with trainer_init"):
        engine.send_weights()
    assert client.calls == []


def test_a_rendezvous_whose_accepting_side_fails_ends_at_once_not_at_the_timeout():
    def accept_fails() -> None:
        raise OSError("the listener was closed")

    workers = BackgroundCall(time.sleep, 5, what="vLLM workers to join")
    trainer = BackgroundCall(accept_fails, what="the vLLM workers to connect")
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not join: the listener was closed. Check that"):
        _await_group(workers, trainer, timeout=30, hint="Check that ...")
    assert time.monotonic() - start < 2
