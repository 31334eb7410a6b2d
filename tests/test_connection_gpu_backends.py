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
from helpers import FakeEngine, tiny_qwen2
from test_connection import SETTINGS as CONNECTION_SETTINGS
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

from lightning_vllm import WeightSyncTimeoutError
from lightning_vllm._waits import TimedClient
from lightning_vllm.connection import EngineConnection
from lightning_vllm.weights import DeclaredWeights, ModuleWeights, WireWeights, source_metadata
from lightning_vllm.weights.payload import Payload

SETTINGS = replace(CONNECTION_SETTINGS, timeout_seconds=2.0, changed_only=False)


class GPUEngine(FakeEngine):
    """An engine built with vLLM's ``nccl`` or ``ipc`` backend: it records the control calls (no NCCL here)."""

    def __init__(self, model, backend: str) -> None:
        super().__init__(model)
        self.backend = backend
        self.init_infos: list[dict] = []
        self.update_infos: list[dict] = []
        self.paused = 0

    def transfer_backend(self) -> str:
        return self.backend

    def device_type(self) -> str:
        return "cuda"

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.init_infos.append(init_info)

    def update_weights(self, update_info: dict) -> None:
        self.update_infos.append(update_info)

    def pause_generation(self, mode: str) -> None:
        self.paused += 1


@pytest.fixture
def trainer_has_cuda(monkeypatch):
    """Our own check passes as on a GPU trainer; vLLM's engine then meets the missing device itself."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_vllms_trainer_engine_gets_the_wire_as_its_source_when_the_group_forms(backend, monkeypatch, trainer_has_cuda):
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
    source = handed["source"]
    assert isinstance(source, DeclaredWeights)
    assert source_metadata(source) == metadata  # what every push sends, names, serving dtypes and shapes
    if hasattr(source, "implements_iter_full"):  # vLLM 0.33 checked it before anything else
        assert source.implements_iter_full() and source.owned_names(0) == list(metadata)


def nccl_connection(engine, model, broadcast, timeout_seconds=2.0):
    """A connection over vLLM's real NCCL trainer engine, whose broadcast (the NCCL call) is ``broadcast``."""
    wire = source_metadata(ModuleWeights(model))
    client = TimedClient(engine, timeout_seconds)
    transfer = NCCLTrainerWeightTransferEngine(client=client, source=DeclaredWeights(wire))
    transfer._broadcast = broadcast  # type: ignore[method-assign]
    settings = replace(SETTINGS, backend="nccl", timeout_seconds=timeout_seconds)
    return EngineConnection(
        engine, settings, client, transfer, wire, False, backend="nccl", device=torch.device("cuda")
    )


def test_an_nccl_push_hands_vllm_the_weights_on_the_gpu_in_the_wire_dtypes_and_commits_the_version():
    model = tiny_qwen2()
    engine = GPUEngine(model, "nccl")
    broadcasts = []
    connection = nccl_connection(engine, model, lambda source, meta: broadcasts.append((source, list(meta))))

    connection.push(Payload(ModuleWeights(model)), version=1)

    ((source, meta),) = broadcasts
    assert isinstance(source, WireWeights) and source.device == torch.device("cuda")
    assert [m.name for m in meta] == list(source_metadata(ModuleWeights(model)))
    assert engine.update_infos[0]["names"] == [m.name for m in meta]  # the workers size their buffers from it
    assert engine.version == "1" and engine.paused == 1  # committed at finish; paused around the transfer
    connection.push(Payload(ModuleWeights(model)), version=2)
    assert engine.version == "2" and len(broadcasts) == 2


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
