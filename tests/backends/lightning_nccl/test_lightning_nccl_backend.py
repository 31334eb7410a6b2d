"""``lightning_nccl``'s trainer side: vLLM's NCCL trainer engine under our name, and a join that closes what a trainer
that died before its commit left open on the workers."""

from __future__ import annotations

import pytest

from lightning_vllm.backends.base import GroupSettings
from lightning_vllm.backends.lightning_nccl.backend import StagedNCCLBackend, StagedNCCLTrainerInitInfo
from lightning_vllm.backends.nccl.backend import NCCLBackend
from lightning_vllm.backends.registry import backend_named

SETTINGS = GroupSettings("127.0.0.1", 29555, 2, 1 << 20, 10.0)


class Client:
    """Answers the close as vLLM's worker does: with ``error`` (none: an update was open, and is closed)."""

    def __init__(self, error: Exception | None) -> None:
        self.error, self.closes = error, 0

    def close_open_update(self) -> None:
        self.closes += 1
        if self.error is not None:
            raise self.error


class Sender:
    def __init__(self) -> None:
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True


def test_its_init_info_names_it_to_vllms_trainer_factory_and_otherwise_is_nccls():
    info = backend_named("lightning_nccl").init_info(SETTINGS)
    assert isinstance(info, StagedNCCLTrainerInitInfo) and info.backend == "lightning_nccl"
    assert (info.master_port, info.world_size, info.packed, info.packed_buffer_size_bytes) == (29555, 2, True, 1 << 20)
    assert not StagedNCCLBackend.traits.loads_while_receiving  # staged: generation paused around the commit alone


@pytest.mark.parametrize(
    "answer",
    [None, RuntimeError("finish_weight_update called without a matching start_weight_update.")],
    ids=["an update left open", "none open"],
)
def test_joining_closes_an_update_a_dead_trainer_left_open(monkeypatch, answer):
    sender = Sender()
    monkeypatch.setattr(NCCLBackend, "join", lambda self, settings, client, metadata: sender)
    client = Client(answer)
    assert StagedNCCLBackend().join(SETTINGS, client, {}) is sender
    assert client.closes == 1 and not sender.shut


def test_a_join_whose_close_fails_otherwise_leaves_the_group_and_says_why(monkeypatch):
    sender = Sender()
    monkeypatch.setattr(NCCLBackend, "join", lambda self, settings, client, metadata: sender)
    with pytest.raises(ConnectionError, match="engine went away"):
        StagedNCCLBackend().join(SETTINGS, Client(ConnectionError("engine went away")), {})
    assert sender.shut
