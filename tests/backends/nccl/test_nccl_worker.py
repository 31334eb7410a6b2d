"""The watched NCCL worker engine: a receive left waiting by a failed trainer ends, and nothing after the failure is
loaded. NCCL itself is a stand-in here (what it reports and what its abort wakes); the GPU tier runs it for real
(``tests/gpu/nccl``), and ``tests/gpu/nccl/peer_failure_probe.py`` measured what NCCL does."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from lightning_vllm.backends.nccl.worker import GroupWatch, PeerFailedError, WatchedNCCLWeightTransferEngine

REMOTE_ERROR = 6


class StandInNCCL:
    """What the watch calls of vLLM's NCCL wrapper: the asynchronous error (from ``fail_after`` seconds on, a remote
    error) and the abort, which wakes whatever waits on ``aborted``."""

    def __init__(self, fail_after: float | None) -> None:
        self.started = time.monotonic()
        self.fail_after = fail_after
        self.aborted = threading.Event()
        self.lib = self  # (the watch reads the C function from the library)

    def ncclCommGetAsyncError(self, comm: object, result: ctypes._CArgObject) -> int:  # noqa: N802
        failing = self.fail_after is not None and time.monotonic() - self.started >= self.fail_after
        result._obj.value = REMOTE_ERROR if failing else 0  # type: ignore[attr-defined]
        return 0

    def ncclCommAbort(self, comm: object) -> None:  # noqa: N802  # (NCCL's name)
        self.aborted_at = time.monotonic()
        self.aborted.set()


class StandInGroup:
    """vLLM's ``PyNcclCommunicator`` as the watch sees it."""

    def __init__(self, fail_after: float | None) -> None:
        self.nccl = StandInNCCL(fail_after)
        self.comm = object()
        self.device = torch.device("cpu")
        self.disabled, self.available = False, True


class Loads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[str] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.loaded += [name for name, _ in weights]
        return {name for name, _ in weights}


def worker_engine(group: StandInGroup) -> WatchedNCCLWeightTransferEngine:
    engine = WatchedNCCLWeightTransferEngine.__new__(WatchedNCCLWeightTransferEngine)  # (no VllmConfig needed)
    engine.model_update_group, engine.model, engine.packed = group, Loads(), True
    engine.finished = []  # type: ignore[attr-defined]
    engine.finish_weight_update = lambda: engine.finished.append("finalize")  # type: ignore[attr-defined,method-assign]
    return engine


def vllm_receive_stuck_after_one_chunk(monkeypatch: pytest.MonkeyPatch, group: StandInGroup) -> None:
    """vLLM's receive as it goes when the trainer fails after one chunk: the next broadcast waits until the group is
    aborted (at most 10 s here), then what its buffer holds is handed to ``load_weights``."""

    def receive(self: NCCLWeightTransferEngine, update_info: NCCLWeightTransferUpdateInfo) -> None:
        self.model.load_weights([("first", torch.zeros(1))])
        assert group.nccl.aborted.wait(10), "the receive was never woken"
        self.model.load_weights([("second", torch.zeros(1))])

    monkeypatch.setattr(NCCLWeightTransferEngine, "receive_weights", receive)


def test_a_receive_left_waiting_by_a_failed_trainer_ends_with_an_error_and_loads_nothing_after_it(monkeypatch):
    group = StandInGroup(fail_after=0.3)
    engine = worker_engine(group)
    vllm_receive_stuck_after_one_chunk(monkeypatch, group)

    started = time.monotonic()
    with pytest.raises(PeerFailedError, match="remote error.*joins a new group"):
        engine.receive_weights(NCCLWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[]))

    assert group.nccl.aborted_at - started < 1.0  # the failure shows at 0.3 s, polled every 0.1 s
    assert engine.model.loaded == ["first"]  # what arrived after the failure was refused
    assert group.disabled and not group.available  # vLLM's communicator makes no more NCCL calls
    assert engine.model_update_group is None  # aborted: shutdown has nothing to destroy
    assert "load_weights" not in engine.model.__dict__  # the model's own loader again
    assert engine.finished == ["finalize"]  # vLLM's layer-wise reload ended: no layer left on the meta device


def test_a_layer_the_failed_push_had_not_finished_gets_its_weights_back_not_a_partial_build():
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, get_layerwise_info

    engine = worker_engine(StandInGroup(fail_after=None))
    engine.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    partial, whole, untouched = engine.model
    for layer, received in ((partial, 3), (whole, 0), (untouched, 0)):
        info = get_layerwise_info(layer)
        info.load_numel_total, info.load_numel = 6, received
        info.kernel_tensors = ({"weight": layer.weight, "bias": layer.bias}, {})
    get_layerwise_info(whole).load_numel_total = None  # finished: vLLM processed it and reset its record

    engine._restore_unfinished_layers()

    assert get_layerwise_info(partial).load_numel == 0  # vLLM's finalize puts its kernel tensors back
    assert get_layerwise_info(partial).loaded_weights == []
    assert engine.finished == ["finalize"]
    for layer in engine.model:
        LAYERWISE_INFO.pop(layer, None)


def test_a_receive_that_ends_is_left_as_it_was(monkeypatch):
    group = StandInGroup(fail_after=None)
    engine = worker_engine(group)

    def receive(self: NCCLWeightTransferEngine, update_info: NCCLWeightTransferUpdateInfo) -> None:
        time.sleep(0.25)  # a few polls
        self.model.load_weights([("first", torch.zeros(1)), ("second", torch.zeros(1))])

    monkeypatch.setattr(NCCLWeightTransferEngine, "receive_weights", receive)

    engine.receive_weights(NCCLWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[]))

    assert engine.model.loaded == ["first", "second"]
    assert engine.model_update_group is group and not group.disabled and not group.nccl.aborted.is_set()
    assert "load_weights" not in engine.model.__dict__


def test_the_watch_stops_with_the_receive():
    group = StandInGroup(fail_after=None)
    with GroupWatch(group, poll_seconds=0.01) as watch:
        time.sleep(0.05)
    assert not watch.failed
    assert not any(thread.name == "lightning-vllm-nccl-watch" for thread in threading.enumerate())


def test_the_plugin_puts_the_watched_engine_under_vllms_nccl_name():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from lightning_vllm.in_vllm.plugin import register_backends

    register_backends()
    register_backends()  # (vLLM may load plugins more than once)
    assert WeightTransferEngineFactory._registry["nccl"]() is WatchedNCCLWeightTransferEngine


def test_a_new_trainers_group_replaces_the_one_still_held_after_leaving_it(monkeypatch):
    """A trainer killed between two pushes never released its group: the next one's join leaves it first."""
    joined = []
    monkeypatch.setattr(NCCLWeightTransferEngine, "init_transfer_engine", lambda self, info: joined.append(info))
    group = StandInGroup(fail_after=None)
    destroyed = []
    group.destroy = lambda: destroyed.append(True)  # type: ignore[attr-defined]
    engine = worker_engine(group)

    engine.init_transfer_engine("the next trainer's init info")

    assert destroyed == [True] and engine.model_update_group is None  # (vLLM's shutdown destroys, then forgets it)
    assert joined == ["the next trainer's init info"]
