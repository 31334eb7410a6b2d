"""``lightning_nccl``'s worker engine, engine-free: a push is staged in the worker's own room and committed whole at
``finish_weight_update``, or not at all. NCCL is a stand-in here (what it reports and what its abort wakes, as in
``tests/backends/nccl/test_nccl_worker.py``); the GPU tier runs the engine in vLLM's own worker over real NCCL
(``tests/gpu/nccl/test_lightning_nccl_llm.py``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from backends.nccl.test_nccl_worker import StandInGroup
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from lightning_vllm.backends.lightning_nccl.worker import StagedNCCLWeightTransferEngine, StagingRoom
from lightning_vllm.backends.nccl.worker import PeerFailedError

NAMES = ["up.weight", "down.weight"]
SHAPES = [[2, 3], [3, 2]]


class Model(torch.nn.Module):
    """A model whose ``load_weights`` copies each tensor into the parameter of its name, as vLLM's loaders do for
    weights used as loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(3, 2, bias=False)
        self.down = torch.nn.Linear(2, 3, bias=False)
        self.loader_calls = 0

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.loader_calls += 1
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return {name for name, _ in weights}


def staged_engine(in_place: bool = True) -> StagedNCCLWeightTransferEngine:
    config = SimpleNamespace(parallel_config=None, model_config=None, cache_config=None)
    engine = StagedNCCLWeightTransferEngine(None, config, torch.device("cpu"), Model())  # type: ignore[arg-type]
    engine.in_place = in_place  # (as on a GPU where vLLM uses the weights as loaded)
    engine.model_update_group = StandInGroup(fail_after=None)
    return engine


def update(names: list[str] = NAMES) -> NCCLWeightTransferUpdateInfo:
    return NCCLWeightTransferUpdateInfo(names=names, dtype_names=["float32"] * len(names), shapes=SHAPES[: len(names)])


def receiving(engine: StagedNCCLWeightTransferEngine, values: dict[str, float], fail_half_way: bool = False):
    """``_receive`` as NCCL's packed consumer runs it: one chunk per tensor handed to the engine's staging, the
    trainer's side failing (a remote error, the group aborted) after the first when ``fail_half_way``."""

    def receive(group: StandInGroup) -> None:
        for index, (name, shape) in enumerate(zip(NAMES, SHAPES)):
            engine._stage([(name, torch.full(shape, values[name]))])
            if fail_half_way and index == 0:
                group.nccl.fail_after = 0.0
                assert group.nccl.aborted.wait(10), "the watch never aborted the group"
                raise RuntimeError("NCCL error: remote process exited or there was a network error")

    return receive


def live(engine: StagedNCCLWeightTransferEngine) -> dict[str, float]:
    return {name: float(param.detach().mean()) for name, param in engine.model.named_parameters()}


def test_a_push_touches_the_live_weights_only_at_its_commit_and_later_commits_replay_the_recorded_copies():
    engine = staged_engine()
    before = live(engine)
    engine.start_weight_update()
    engine._receive = receiving(engine, {"up.weight": 1.0, "down.weight": 2.0})  # type: ignore[method-assign]
    engine.receive_weights(update())
    assert live(engine) == before  # received into the room: the engine serves what it served
    engine.finish_weight_update()
    assert live(engine) == {"up.weight": 1.0, "down.weight": 2.0}
    assert engine.model.loader_calls == 1  # the first commit through the model's loaders, recorded

    engine.start_weight_update()
    engine._receive = receiving(engine, {"up.weight": 3.0, "down.weight": 4.0})  # type: ignore[method-assign]
    engine.receive_weights(update(names=[]))  # vLLM's trainer names nothing when the tensors did not change
    engine.finish_weight_update()
    assert live(engine) == {"up.weight": 3.0, "down.weight": 4.0}
    assert engine.model.loader_calls == 1 and engine.loads.replayed == 1  # the room stayed put: copies replayed
    assert engine.room.nbytes == 4 * (6 + 6)  # one copy of the weights, kept


def test_a_push_whose_trainer_fails_half_way_leaves_the_last_committed_weights_and_commits_nothing():
    engine = staged_engine()
    engine._receive = receiving(engine, {"up.weight": 1.0, "down.weight": 2.0})  # type: ignore[method-assign]
    engine.receive_weights(update())
    engine.finish_weight_update()
    committed = live(engine)

    engine.start_weight_update()
    engine._receive = receiving(engine, {"up.weight": 5.0, "down.weight": 6.0}, fail_half_way=True)  # type: ignore[method-assign]
    with pytest.raises(PeerFailedError, match="nothing of the push was loaded"):
        engine.receive_weights(update())
    assert live(engine) == committed and engine.model_update_group is None  # the group was aborted
    engine.start_weight_update()  # the trainer's clean-up: an empty update, closed
    engine.finish_weight_update()
    assert live(engine) == committed


def test_what_a_trainer_that_died_before_its_commit_staged_is_discarded_when_the_next_trainer_joins(monkeypatch):
    engine = staged_engine()
    engine._receive = receiving(engine, {"up.weight": 7.0, "down.weight": 8.0})  # type: ignore[method-assign]
    engine.start_weight_update()
    engine.receive_weights(update())  # every byte arrived; the trainer died before its finish_weight_update
    before = live(engine)
    engine.model_update_group.destroy = lambda: None  # type: ignore[union-attr]  # (the dead trainer's, left)
    monkeypatch.setattr(NCCLWeightTransferEngine, "init_transfer_engine", lambda *_: None)  # (NCCL's rendezvous)
    engine.init_transfer_engine(SimpleNamespace())  # the next trainer's group
    engine.finish_weight_update()  # the close the next trainer sends first (backends/lightning_nccl/backend.py)
    assert live(engine) == before  # the dead trainer's push never landed


def test_an_update_that_staged_part_of_what_it_named_commits_nothing():
    engine = staged_engine()
    engine.start_weight_update()
    engine._expected = [(name, "float32", shape) for name, shape in zip(NAMES, SHAPES)]
    engine._stage([("up.weight", torch.ones(2, 3))])
    before = live(engine)
    with pytest.raises(RuntimeError, match=r"incomplete \(1 of 2 tensors missing, the first 'down.weight'\)"):
        engine.finish_weight_update()
    assert live(engine) == before


def test_the_room_is_allocated_once_per_tensor_and_goes_to_host_memory_with_one_warning_when_the_gpu_is_full(
    monkeypatch, caplog
):
    room = StagingRoom(torch.device("cpu"))
    first = room.tensor_for("w", [2, 3], torch.float32)
    assert room.tensor_for("w", [2, 3], torch.float32) is first and room.allocations == 1
    assert room.tensor_for("w", [3, 3], torch.float32) is not first and room.allocations == 2  # another shape

    empty = torch.empty

    def full_device(*args, **kwargs):
        if "device" in kwargs:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", full_device)
    with caplog.at_level(logging.WARNING):
        room.tensor_for("a", [4], torch.float32)
        room.tensor_for("b", [4], torch.float32)
    assert room.on_host and [record.message for record in caplog.records].count(caplog.records[0].message) == 1
    assert "pinned host memory" in caplog.records[0].message
