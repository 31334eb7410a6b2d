"""``lightning_ipc``'s trainer engine: a handle for a tensor the worker has not opened, a slot number for one
it holds in the same storage and view, and the old slot released when a tensor moves. Engine-free: the CUDA
calls are replaced (this machine has no GPU) and the client records what the worker would be told; the
worker's half runs on the GPU tier (``tests/gpu/test_gpu_lightning_ipc.py``)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from lightning_vllm.backends.lightning_ipc import trainer as ipc_trainer
from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesIPCTrainerEngine, KeptHandlesTrainerInitInfo
from lightning_vllm.backends.lightning_ipc.worker import KeptHandlesUpdateInfo, update_in_one_call
from lightning_vllm.errors import WeightSyncTimeoutError
from lightning_vllm.weights import EngineWeights, MappingWeights, ModuleWeights


class RecordingClient:
    """Takes the calls vLLM's trainer engine makes to an engine, and keeps the updates."""

    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        self.updates.append(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")

    def update_weights_in_one_call(self, update_on_worker: Any, update_info: dict[str, Any]) -> None:
        assert update_on_worker is update_in_one_call
        self.calls.append("one call")
        self.updates.append(update_info)


class LandedEvent:
    """Stands in for the trainer's interprocess CUDA event: done after ``pending`` queries."""

    pending = 0
    queries = 0

    def __init__(self, interprocess: bool = False) -> None:
        assert interprocess

    def ipc_handle(self) -> bytes:
        return b"event"

    def query(self) -> bool:
        LandedEvent.queries += 1
        return LandedEvent.queries > LandedEvent.pending


@pytest.fixture(params=[False, True], ids=["three calls", "one call"])
def in_one_call(request: pytest.FixtureRequest) -> bool:
    """Whether the engine takes start, update and finish as one call (``engines/base.UpdatesInOneCall``)."""
    return bool(request.param)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, in_one_call: bool) -> KeptHandlesIPCTrainerEngine:
    monkeypatch.setattr(LandedEvent, "pending", 0)
    monkeypatch.setattr(LandedEvent, "queries", 0)
    monkeypatch.setattr(torch.cuda, "Event", LandedEvent)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("Props", (), {"uuid": "GPU-0"})())
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    # A handle says which storage and view it was made of.
    monkeypatch.setattr(ipc_trainer, "reduce_tensor", lambda tensor: (None, ("handle", tensor.data_ptr())))
    return KeptHandlesIPCTrainerEngine.trainer_init(
        KeptHandlesTrainerInitInfo(packed=False, rank=0, landed_timeout_seconds=0.5, updates_in_one_call=in_one_call),
        client=RecordingClient(),
        source=MappingWeights({"a": torch.zeros(2), "b": torch.zeros(3)}),
    )


def push(engine: KeptHandlesIPCTrainerEngine, tensors: dict[str, torch.Tensor]) -> KeptHandlesUpdateInfo:
    engine.source = MappingWeights(tensors)
    engine.send_weights()
    update = engine.client.updates[-1]  # type: ignore[attr-defined]
    return KeptHandlesUpdateInfo(**update)  # what the worker parses (vLLM's checks included)


def test_a_handle_goes_once_while_the_storage_stays_put(engine):
    a, b = torch.zeros(2), torch.zeros(3)
    first = push(engine, {"a": a, "b": b})
    assert first.ipc_handles == [{"GPU-0": ("handle", a.data_ptr())}, {"GPU-0": ("handle", b.data_ptr())}]
    assert first.slots == [0, 1] and first.released == []
    a.add_(1)  # an optimizer step writes in place
    second = push(engine, {"a": a, "b": b})
    assert second.ipc_handles == [{}, {}] and second.slots == [0, 1] and second.released == []
    assert engine.handles_sent == 2
    one_push = ["one call"] if engine.updates_in_one_call else ["start", "update", "finish"]
    assert engine.client.calls == ["init", *one_push, *one_push]


def test_a_tensor_that_moved_or_changed_its_view_gets_a_new_slot_and_the_old_one_is_released(engine):
    a, b = torch.zeros(2), torch.zeros(3)
    push(engine, {"a": a, "b": b})
    moved = push(engine, {"a": a.clone(), "b": b})
    assert moved.slots == [2, 1] and moved.released == [0] and moved.ipc_handles[1] == {}
    storage = torch.zeros(6)
    push(engine, {"a": a, "b": storage[:3]})
    reviewed = push(engine, {"a": a, "b": storage[3:]})  # the same storage, another view
    assert reviewed.released == [4] and reviewed.slots[1] == 5 and reviewed.ipc_handles[1] != {}


def test_a_freed_tensor_never_passes_for_a_new_one_at_its_address(engine):
    push(engine, {"a": torch.ones(2), "b": torch.ones(3)})  # computed for the push, then freed
    again = push(engine, {"a": torch.ones(2), "b": torch.ones(3)})
    assert again.released == [0, 1] and again.slots == [2, 3] and all(again.ipc_handles)


def test_a_non_contiguous_tensor_is_sent_as_a_contiguous_copy_each_time(engine):
    grid = torch.arange(6.0).reshape(2, 3)
    push(engine, {"a": grid[:, 0], "b": torch.zeros(3)})
    again = push(engine, {"a": grid[:, 0], "b": torch.zeros(3)})
    assert again.released[0] == 0 and again.ipc_handles[0] != {}


def test_the_push_returns_once_the_worker_recorded_the_event_sent_with_its_first_update(engine):
    a, b = torch.zeros(2), torch.zeros(3)
    assert push(engine, {"a": a, "b": b}).landed_event == b"event"
    LandedEvent.pending, LandedEvent.queries = 3, 0  # the worker's copies still run for three queries
    assert push(engine, {"a": a, "b": b}).landed_event is None  # the worker keeps the one it opened
    assert LandedEvent.queries == 4


def test_copies_that_never_end_give_an_error_within_the_timeout(engine):
    a, b = torch.zeros(2), torch.zeros(3)
    push(engine, {"a": a, "b": b})
    LandedEvent.pending, LandedEvent.queries = 10**9, 0
    with pytest.raises(WeightSyncTimeoutError, match=r"did not end within 0.5 s \(timeout_seconds\)"):
        push(engine, {"a": a, "b": b})


def test_a_push_of_the_same_tensors_in_their_kept_slots_sends_the_last_update_again(engine):
    a, b = torch.zeros(2), torch.zeros(3)
    push(engine, {"a": a, "b": b})
    second = push(engine, {"a": a, "b": b})
    third = push(engine, {"a": a, "b": b})
    assert engine.client.updates[-1] is engine.client.updates[-2]  # nothing rebuilt per tensor
    assert third == second and third.ipc_handles == [{}, {}] and third.landed_event is None
    moved = push(engine, {"a": a, "b": b.clone()})  # one moved: a new update, with its handle
    assert moved.released == [1] and moved.ipc_handles[1] != {}
    assert push(engine, {"a": a}).names == ["a"]  # a subset: its own update


def push_module(engine: KeptHandlesIPCTrainerEngine, module: torch.nn.Module, **wire: Any) -> KeptHandlesUpdateInfo:
    """A push of ``module``'s parameters, as a connection hands them over (under the engine's names and dtypes)."""
    source = ModuleWeights(module)
    engine.source = EngineWeights(source, {meta.name: (meta.dtype, meta.shape) for meta in source.metadata}, **wire)
    engine.send_weights()
    return KeptHandlesUpdateInfo(**engine.client.updates[-1])  # type: ignore[attr-defined]


def test_the_tensors_a_source_holds_are_checked_against_the_kept_slots_without_being_read(engine, monkeypatch):
    net = torch.nn.Linear(3, 3)
    push_module(engine, net)
    push_module(engine, net)  # every tensor in its kept slot: the update is kept
    read = []
    monkeypatch.setattr(ModuleWeights, "iter_full", lambda self: read.append(self) or iter(()))
    with torch.no_grad():
        net.weight.add_(1)  # an optimizer step writes in place
    kept = push_module(engine, net)
    assert read == [] and engine.client.updates[-1] is engine.client.updates[-2]
    assert kept.ipc_handles == [{}, {}] and kept.slots == [0, 1]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda net: setattr(net.weight, "data", net.weight.data.clone()), id="new storage"),
        pytest.param(lambda net: setattr(net.weight, "data", net.weight.data.t()), id="same address, another view"),
    ],
)
def test_a_held_tensor_that_moved_or_changed_its_view_is_sent_anew(engine, change):
    net = torch.nn.Linear(3, 3)
    push_module(engine, net)
    push_module(engine, net)
    change(net)
    moved = push_module(engine, net)
    assert moved.released == [0] and moved.slots == [2, 1] and moved.ipc_handles[0] != {} and moved.ipc_handles[1] == {}
    assert engine.client.updates[-1] is not engine.client.updates[-2]


class _Tallied(list):
    """Records the names :class:`SentSums` would be told."""

    def tally(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, held: bool) -> None:
        self.append(name)


def test_a_push_that_tallies_what_it_sends_reads_every_tensor(engine):
    net = torch.nn.Linear(3, 3)
    tallied = _Tallied()
    for _ in range(3):
        push_module(engine, net, sums=tallied)
    assert tallied == ["weight", "bias"] * 3  # (the check after the push sums what was sent)


def test_a_caller_that_waits_for_the_copies_itself_gets_send_weights_back_while_they_run(engine):
    engine.caller_waits = True  # as the sender does (backends/vllm_engines.py), on the pushing thread
    a, b = torch.zeros(2), torch.zeros(3)
    push(engine, {"a": a, "b": b})
    engine.wait_until_landed()
    LandedEvent.pending, LandedEvent.queries = 3, 0
    push(engine, {"a": a, "b": b})
    assert LandedEvent.queries == 0  # returned with the copies running
    engine.wait_until_landed()
    assert LandedEvent.queries == 4
    engine.wait_until_landed()  # nothing pending: no wait
    assert LandedEvent.queries == 4


def test_the_callers_wait_ends_at_its_deadline_or_when_its_check_finds_the_engine_dead(engine):
    engine.caller_waits = True
    a, b = torch.zeros(2), torch.zeros(3)
    push(engine, {"a": a, "b": b})
    engine.wait_until_landed()
    LandedEvent.pending, LandedEvent.queries = 10**9, 0
    push(engine, {"a": a, "b": b})
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="did not end"):
        engine.wait_until_landed(deadline=started + 0.1)
    assert time.monotonic() - started < 0.4  # (the engine's own bound is 0.5 s)

    def dead() -> None:
        raise RuntimeError("the engine core died")

    push(engine, {"a": a, "b": b})
    with pytest.raises(RuntimeError, match="died"):
        engine.wait_until_landed(dead, check_seconds=0.01)


def test_each_push_carries_the_deadline_its_caller_set_and_a_kept_update_is_not_changed_by_it(engine):
    a, b = torch.zeros(2), torch.zeros(3)
    assert push(engine, {"a": a, "b": b}).apply_before is None  # none set: none sent
    engine.apply_before = 100.0
    assert push(engine, {"a": a, "b": b}).apply_before == 100.0
    engine.apply_before = 200.0
    assert push(engine, {"a": a, "b": b}).apply_before == 200.0  # the kept slots' update, with this push's deadline
    assert "apply_before" not in engine._kept  # (the kept info itself holds none: each push adds its own)


def test_a_checked_push_asks_the_worker_to_leave_its_sums_where_the_trainer_reads_them(engine, monkeypatch):
    from lightning_vllm.backends.lightning_ipc import sums_mailbox
    from lightning_vllm.weights.layer_sums import layer_key

    on_cpu = lambda device, tensors: sums_mailbox.SumsMailbox(torch.device("cpu"), tensors)  # noqa: E731
    monkeypatch.setattr(ipc_trainer, "SumsMailbox", on_cpu)
    a, b = torch.zeros(2), torch.zeros(3)
    assert push(engine, {"a": a, "b": b}).sums_push is None and engine.mailed_sums() is None  # not checked
    engine.sums_wanted = True
    first = push(engine, {"a": a, "b": b})
    assert first.sums_mailbox is not None and first.sums_push == 1  # the tensor's handle, once
    assert engine.mailed_sums() is None and not engine.sums_expected  # the worker left nothing
    second = push(engine, {"a": a, "b": b})
    assert second.sums_mailbox is None and second.sums_push == 2 and second.slots == [0, 1]
    assert engine._mailbox is not None
    sums_mailbox.post_sums(engine._mailbox.tensor, 2, torch.tensor([[layer_key("a"), 1, 2]]))  # (the worker)
    assert engine.mailed_sums() == [{"sharded": {}, "replicated": {"a": [1, 2]}, "unverifiable": {}, "stale": {}}]
    assert engine.sums_expected
