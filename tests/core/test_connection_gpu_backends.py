"""vLLM's own GPU engines (``nccl``, ``ipc``) driven by our connection on a CPU machine, up to where
CUDA is needed: the source they are handed, what the engine is told, commits and bounded waits.

The GPU runs themselves are in ``benchmarks/gpu/`` (docs/gpu.md); these tests keep the trainer
side honest on every machine, under vLLM 0.32 and 0.33.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from helpers import FakeEngine, half_way, raises, tiny_qwen2
from test_connection import SETTINGS as CONNECTION_SETTINGS
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

from lightning_vllm import EngineConfigError, EngineDeadError, WeightSyncTimeoutError
from lightning_vllm._waits import BackgroundCall
from lightning_vllm.backends.registry import backend_named
from lightning_vllm.backends.vllm_engines import ReplayedClient, ReplayedWeights, VLLMEngineSender
from lightning_vllm.core import after_failure
from lightning_vllm.core.connection import EngineConnection
from lightning_vllm.engines.base import mixed_weight_version, parse_weight_version
from lightning_vllm.engines.client import TimedClient
from lightning_vllm.weights import DeclaredWeights, EngineWeights, ModuleWeights, source_metadata
from lightning_vllm.weights.payload import Payload

SETTINGS = replace(CONNECTION_SETTINGS, timeout_seconds=2.0, changed_only=False)


class GPUEngine(FakeEngine):
    """An engine built with vLLM's ``nccl`` or ``ipc`` backend: it records the control calls (no NCCL here),
    and keeps the update's state as vLLM 0.33's GPU worker does (``gpu_worker.py``): one update at a time,
    no release of the connection inside one, an ``update_weights`` that fails ends the update but leaves
    layer-wise reload open until an update finishes."""

    def __init__(self, model, backend: str, ipc_problem: str | None = None) -> None:
        super().__init__(model)
        self.backend = backend
        self.init_infos: list[dict] = []
        self.update_infos: list[dict] = []
        self.paused = 0
        self.calls: list[str] = []
        self.active = False  # the worker's _weight_update_active
        self.reloading = False  # layers left in layer-wise reload (meta tensors: nothing can be generated)
        self.fail_update_weights = False
        self.ipc_problem = ipc_problem

    def ipc_handles_problem(self) -> str | None:
        return self.ipc_problem

    def start_weight_update(self) -> None:
        self.calls.append("start")
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.active = self.reloading = True

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.active = self.reloading = False
        if weight_version is not None:
            self.version = weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append("shutdown")
        if self.active:
            raise RuntimeError("Cannot release a trainer connection during a weight update")

    def resume_generation(self) -> None:
        self.calls.append("resume")

    def transfer_backend(self) -> str:
        return self.backend

    def device_type(self) -> str:
        return "cuda"

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.init_infos.append(init_info)

    def update_weights(self, update_info: dict) -> None:
        assert self.active, "start_weight_update must be called before update_weights."
        self.update_infos.append(update_info)
        if self.fail_update_weights:
            self.active = False  # as vLLM's worker does; its layers stay in layer-wise reload
            raise RuntimeError("the worker could not load the weights")

    def pause_generation(self, mode: str) -> None:
        self.paused += 1


@pytest.fixture
def trainer_has_cuda(monkeypatch):
    """Our own check passes as on a GPU trainer; vLLM's engine then meets the missing device itself."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_vllms_trainer_engine_gets_the_engines_metadata_as_its_source_when_the_group_forms(
    backend, monkeypatch, trainer_has_cuda
):
    model = tiny_qwen2()
    metadata = source_metadata(ModuleWeights(model))
    engine = GPUEngine(model, backend)
    handed = {}
    trainer_init = WeightTransferTrainerFactory.trainer_init

    def spy(init_info, *, client, source=None):
        handed["source"] = source
        return trainer_init(init_info, client=client, source=source)

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", staticmethod(spy))
    # vLLM 0.32's engines refused here with "requires a WeightSource"; now the first thing missing is the GPU.
    with pytest.raises(RuntimeError, match="accelerator device"):
        EngineConnection.open(engine, metadata, replace(SETTINGS, backend="auto"))
    source = handed["source"]  # kept by vLLM's engine: each push loads its own weights into it
    assert isinstance(source, ReplayedWeights) and isinstance(source.weights, DeclaredWeights)
    assert source_metadata(source) == metadata  # what every push sends, names, serving dtypes and shapes
    if hasattr(source, "implements_iter_full"):  # vLLM 0.33 checked it before anything else
        assert source.implements_iter_full() and source.owned_names(0) == list(metadata)


CUDA = torch.device("cuda")


def nccl_connection(engine, model, broadcast, timeout_seconds=2.0, device=CUDA, reported_version=0):
    """A connection over vLLM's real NCCL trainer engine, whose broadcast (the NCCL call) is ``broadcast``
    (``device=None``: the weights stay where they are, so that ``broadcast`` may read them here)."""
    engine_metadata = source_metadata(ModuleWeights(model))
    client = TimedClient(engine, timeout_seconds)
    source, replayed = ReplayedWeights(DeclaredWeights(engine_metadata)), ReplayedClient(client)
    transfer = NCCLTrainerWeightTransferEngine(client=replayed, source=source)
    transfer._broadcast = broadcast  # type: ignore[method-assign]
    sender = VLLMEngineSender(transfer, source, replayed, device, timeout_seconds)
    options = replace(SETTINGS, backend="nccl", timeout_seconds=timeout_seconds)
    return EngineConnection(
        engine, options, client, backend_named("nccl"), sender, engine_metadata, False, reported_version
    )


def test_an_nccl_push_hands_vllm_the_weights_on_the_gpu_in_the_engines_dtypes_and_commits_the_version():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    broadcasts = []
    # vLLM's engine broadcasts the source it kept from trainer_init, into which the push loaded its weights.
    connection = nccl_connection(engine, model, lambda source, meta: broadcasts.append((source.weights, list(meta))))

    connection.push(Payload(ModuleWeights(model)), version=1)

    ((source, meta),) = broadcasts
    assert isinstance(source, EngineWeights) and source.device == torch.device("cuda")
    assert [m.name for m in meta] == list(source_metadata(ModuleWeights(model)))
    assert engine.update_infos[0]["names"] == [m.name for m in meta]  # the workers size their buffers from it
    assert engine.version == "1" and engine.paused == 1  # committed at finish; paused around the transfer
    connection.push(Payload(ModuleWeights(model)), version=2)
    assert engine.version == "2" and len(broadcasts) == 2


def test_an_engine_that_generates_only_inside_its_calls_is_not_asked_to_pause():
    from lightning_vllm.engines.base import GeneratesOnlyInCalls

    class InProcessEngine(GPUEngine, GeneratesOnlyInCalls):  # as an in-process vllm.LLM
        def generates_only_in_calls(self) -> bool:
            return True

    model = tiny_qwen2()
    engine = InProcessEngine(model, "nccl")
    connection = nccl_connection(engine, model, lambda source, meta: None)
    pushed = connection.push(Payload(ModuleWeights(model)), version=1)
    assert engine.version == "1" and engine.paused == 0 and engine.calls == ["start", "finish 1"]
    assert pushed.timing.pause_seconds > 0  # the window generation is held for, timed all the same


def test_an_nccl_transfer_that_never_ends_is_an_error_within_the_timeout_and_commits_nothing():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    stuck = threading.Event()  # a receiver killed mid-push: NCCL's broadcast waits forever
    connection = nccl_connection(engine, model, lambda source, meta: stuck.wait(), timeout_seconds=1.0)
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="nccl transfer.*the version was not committed"):
        connection.push(Payload(ModuleWeights(model)), version=1)
    assert time.monotonic() - started < 3.0
    assert engine.version == "default"  # nothing committed
    stuck.set()


def test_ipc_into_an_engine_that_would_refuse_the_handles_is_refused_at_connect_before_a_byte_moves(trainer_has_cuda):
    model = tiny_qwen2()
    engine = GPUEngine(model, "ipc", ipc_problem="VLLM_ALLOW_INSECURE_SERIALIZATION=1 is missing")
    with pytest.raises(EngineConfigError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1 is missing"):
        EngineConnection.open(engine, source_metadata(ModuleWeights(model)), replace(SETTINGS, backend="auto"))
    assert engine.init_infos == [] and engine.calls == []  # nothing asked of the workers


def read_all(source, meta):  # vLLM's broadcast reads every tensor it sends
    for _ in source.iter_full():
        pass


@pytest.mark.parametrize("where", ["trainer side", "worker side"])
def test_a_push_that_fails_half_way_closes_the_update_then_resumes_and_the_next_push_lands(where):
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    connection = nccl_connection(engine, model, read_all, device=None)
    payload = (
        Payload(half_way(model, raises(RuntimeError("the policy could not be read"))))
        if where == "trainer side"
        else Payload(ModuleWeights(model))
    )
    engine.fail_update_weights = where == "worker side"

    with pytest.raises(RuntimeError, match="could not be read" if where == "trainer side" else "could not load"):
        connection.push(payload, version=1)
    after_failure.wait_for(engine, timeout=5.0)  # what the next connection waits for

    assert not engine.active and not engine.reloading  # the update is closed, every layer back in place
    # Nothing committed; the workers had been sent part of version 1 to load as it arrived, so from now on the
    # engine reports the mix: the weights it started with (0) and what it had loaded of 1.
    assert engine.version == mixed_weight_version(0, 1) == "0+1"
    assert parse_weight_version(engine.version) == (0, 1)
    tail = ["finish 0+1", "resume", "shutdown"]  # closed before generation resumes, released after
    assert engine.calls[-len(tail) :] == tail
    if where == "worker side":  # the worker had left the update itself: an empty one put its layers back
        assert engine.calls[-5:-3] == ["finish 0+1", "start"]

    engine.fail_update_weights = False
    engine.calls.clear()
    again = nccl_connection(engine, model, read_all, device=None)
    again.push(Payload(ModuleWeights(model)), version=1)
    assert engine.version == "1" and engine.calls == ["start", "finish 1", "resume"]


def test_a_push_that_fails_before_the_workers_were_sent_anything_leaves_the_version_as_it_was():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    engine.version = "3"
    connection = nccl_connection(engine, model, read_all, device=None, reported_version=3)
    start = engine.start_weight_update
    engine.start_weight_update = raises(RuntimeError("the engine refused to start an update"))
    with pytest.raises(RuntimeError, match="refused to start"):
        connection.push(Payload(ModuleWeights(model)), version=4)
    after_failure.wait_for(engine, timeout=5.0)
    assert engine.version == "3"  # nothing was sent to load: the weights of version 3, whole
    engine.start_weight_update = start


def test_a_push_that_fails_after_a_mix_names_the_last_version_the_engine_committed():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    connection = nccl_connection(engine, model, read_all, device=None, reported_version=0)
    connection.push(Payload(ModuleWeights(model)), version=1)
    engine.fail_update_weights = True
    with pytest.raises(RuntimeError, match="could not load"):
        connection.push(Payload(ModuleWeights(model)), version=2)
    after_failure.wait_for(engine, timeout=5.0)
    assert engine.version == "1+2"


def test_a_new_connection_waits_for_the_end_of_what_a_failed_push_left_running():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    release = threading.Event()
    after_failure.started(engine, BackgroundCall(release.wait, what="a frozen engine's cleanup"))
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="has not ended the update a failed push left open"):
        EngineConnection.open(engine, source_metadata(ModuleWeights(model)), replace(SETTINGS, timeout_seconds=0.5))
    assert 0.4 < time.monotonic() - started < 2.0 and engine.init_infos == []
    release.set()
    after_failure.wait_for(engine, timeout=1.0)  # ended now: nothing left to wait for


def test_a_second_updater_of_the_same_vllm_llm_waits_for_what_the_first_ones_failed_push_left_running():
    """Each updater wraps the ``vllm.LLM`` in a target of its own; the engine under them is one."""
    from lightning_vllm.engines.local import InProcessEngine, LocalLLMEngine

    llm = object()  # (the targets are only asked what they wrap)
    first, second = LocalLLMEngine.__new__(LocalLLMEngine), LocalLLMEngine.__new__(LocalLLMEngine)
    InProcessEngine.__init__(first, llm, config=None, engine_core=None)
    InProcessEngine.__init__(second, llm, config=None, engine_core=None)
    release = threading.Event()
    after_failure.started(first, BackgroundCall(release.wait, what="the first updater's cleanup"))
    with pytest.raises(WeightSyncTimeoutError, match="has not ended the update a failed push left open"):
        after_failure.wait_for(second, timeout=0.2)
    release.set()
    after_failure.wait_for(second, timeout=1.0)


def test_an_engine_that_dies_mid_transfer_ends_the_push_at_once_not_at_the_timeout():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    stuck = threading.Event()  # the broadcast to a dead engine core waits forever; vLLM's client is not woken up

    def dies_then_hangs(source, meta):
        engine.is_dead = lambda: True  # what vLLM's monitor thread sees when the engine core's process exits
        stuck.wait()

    connection = nccl_connection(engine, model, dies_then_hangs, timeout_seconds=30.0)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="has died"):
        connection.push(Payload(ModuleWeights(model)), version=1)
    assert time.monotonic() - started < 2.0
    after_failure.wait_for(engine, timeout=1.0)  # a dead engine is left alone: nothing to wait for
    assert engine.version == "default" and "finish None" not in engine.calls
    stuck.set()


def test_a_transfer_that_outlives_its_timeout_cannot_reach_the_engine_afterwards():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    slow = threading.Event()  # a slow source: the transfer thread goes on after the push timed out

    connection = nccl_connection(engine, model, lambda source, meta: slow.wait(10), timeout_seconds=0.5)
    with pytest.raises(WeightSyncTimeoutError):
        connection.push(Payload(ModuleWeights(model)), version=1)
    after_failure.wait_for(engine, timeout=5.0)  # the update was closed meanwhile
    again = nccl_connection(engine, model, read_all, device=None)
    engine.calls.clear()
    again.push(Payload(ModuleWeights(model)), version=1)  # the next push
    slow.set()  # the old transfer wakes up, and vLLM's engine would now finish "its" update
    time.sleep(0.3)
    assert engine.calls == ["start", "finish 1", "resume"] and engine.version == "1"  # nothing of the old one


@pytest.mark.parametrize("takes_one_call", [False, True])
def test_the_group_plan_says_whether_the_engine_takes_an_update_in_one_call(
    takes_one_call, monkeypatch, trainer_has_cuda
):
    from lightning_vllm.backends.lightning_ipc.backend import InPlaceIPCBackend
    from lightning_vllm.engines.base import UpdatesInOneCall

    class OneCallEngine(GPUEngine, UpdatesInOneCall):
        def update_weights_in_one_call(self, update_info, weight_version):
            raise AssertionError("not called when the group forms")

    model = tiny_qwen2()
    engine = (OneCallEngine if takes_one_call else GPUEngine)(model, "lightning_ipc")
    joined_with = []

    def join(self, settings, client, engine_metadata):
        joined_with.append(settings)
        raise RuntimeError("joined no further")

    monkeypatch.setattr(InPlaceIPCBackend, "join", join)
    with pytest.raises(RuntimeError, match="joined no further"):
        EngineConnection.open(engine, source_metadata(ModuleWeights(model)), replace(SETTINGS, backend="auto"))
    assert joined_with[0].updates_in_one_call is takes_one_call


def test_copies_that_outlast_send_weights_are_waited_for_on_the_pushing_thread_and_late_pushes_are_refused():
    from lightning_vllm.weights.payload import Outgoing

    class CopyingEngine:  # a trainer engine whose workers copy after send_weights returns (lightning_ipc's)
        caller_waits = False

        def __init__(self) -> None:
            self.threads: dict[str, threading.Thread] = {}
            self.apply_before: float | None = None  # its workers refuse a push after it (RefusesLatePushes)
            self.apply_before_at_send: float | None = None

        def send_weights(self) -> None:
            self.threads["send"] = threading.current_thread()
            self.apply_before_at_send = self.apply_before

        def wait_until_landed(self, check, check_seconds, deadline) -> None:
            self.threads["wait"] = threading.current_thread()
            self.check, self.deadline = check, deadline

        def shutdown(self) -> None: ...

    model = tiny_qwen2()
    engine_metadata = source_metadata(ModuleWeights(model))
    engine = CopyingEngine()
    sender = VLLMEngineSender(
        engine, ReplayedWeights(DeclaredWeights(engine_metadata)), ReplayedClient(None), None, 5.0
    )
    assert engine.caller_waits
    client = TimedClient(None, 5.0)
    started = time.monotonic()
    landed = sender.send(Outgoing(ModuleWeights(model), client=client))
    assert engine.threads["send"] is not threading.current_thread()  # the transfer's own thread
    assert "wait" not in engine.threads and landed is not None  # the caller waits, after asking the engine
    assert landed.wait() is None and not landed.brings_sums  # (an engine that leaves no sums)
    assert engine.threads["wait"] is threading.current_thread()
    assert engine.check == client.raise_if_dead and started + 5.0 <= engine.deadline <= time.monotonic() + 5.0
    # The workers stop starting the push half a second (a tenth of the 5 s timeout) before the trainer gives up.
    assert engine.apply_before_at_send == pytest.approx(engine.deadline - 0.5)


def test_an_nccl_push_in_which_nothing_changed_still_sends_its_smallest_layer_group():
    """vLLM's NCCL worker reads an update naming no tensor as the last update's tensors and waits for them for good
    (seen on an H200: the second of two pushes of the same weights hung in update_weights)."""
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    connection = nccl_connection(engine, model, lambda source, meta: None)
    connection.options = replace(connection.options, changed_only=True)

    connection.push(Payload(ModuleWeights(model), stamps=ModuleWeights(model).stamps()), version=1)
    connection.push(Payload(ModuleWeights(model), stamps=ModuleWeights(model).stamps()), version=2)

    everything, unchanged = (info["names"] for info in engine.update_infos)
    groups = EngineWeights(ModuleWeights(model), connection.engine_metadata).groups()
    smallest = min(groups, key=lambda group: sum(dict(model.named_parameters())[name].numel() for name in group))
    assert (
        len(everything) == len(connection.engine_metadata) and unchanged == smallest
    )  # never an update naming nothing
    assert engine.version == "2"


def test_the_sums_a_worker_leaves_come_back_from_the_wait_for_the_copies_of_a_checked_push():
    from lightning_vllm.weights.payload import Outgoing

    class LeavingEngine:  # lightning_ipc's trainer engine, as the sender sees it (MailsSums, CopiesOutlastSend)
        caller_waits = False
        sums_wanted = False
        sums_expected = False

        def send_weights(self) -> None:
            self.wanted_at_send = self.sums_wanted

        def wait_until_landed(self, check, check_seconds, deadline) -> None: ...

        def mailed_sums(self):
            return [{"replicated": {"lm_head": [1, 2]}}] if self.sums_wanted else None

        def shutdown(self) -> None: ...

    model = tiny_qwen2()
    engine = LeavingEngine()
    sender = VLLMEngineSender(
        engine, ReplayedWeights(DeclaredWeights(source_metadata(ModuleWeights(model)))), ReplayedClient(None), None, 5.0
    )
    client = TimedClient(None, 5.0)
    unchecked = sender.send(Outgoing(ModuleWeights(model), client=client, checked=False))
    assert unchecked is not None and not engine.wanted_at_send and unchecked.wait() is None
    checked = sender.send(Outgoing(ModuleWeights(model), client=client, checked=True))
    assert checked is not None and engine.wanted_at_send and not checked.brings_sums  # (none left before)
    assert checked.wait() == [{"replicated": {"lm_head": [1, 2]}}]
    engine.sums_expected = True  # (it left them)
    assert sender.send(Outgoing(ModuleWeights(model), client=client, checked=True)).brings_sums
