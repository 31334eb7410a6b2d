"""One engine's connection: what is refused before any byte moves, and one push, against the fake engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import FakeEngine, tiny_qwen2

from lightning_vllm import EngineConfigError, WeightsMismatchError
from lightning_vllm.core.connection import EngineConnection
from lightning_vllm.options import UpdaterOptions
from lightning_vllm.weights import DeclaredWeights, ModuleWeights, source_metadata
from lightning_vllm.weights.payload import Payload

SETTINGS = UpdaterOptions(bucket_size_bytes=1 << 20, timeout_seconds=10.0)


class MisconfiguredEngine(FakeEngine):
    """A fake engine built with another backend (or none) and two tensor-parallel workers."""

    def __init__(self, model, backend):
        super().__init__(model)
        self.backend = backend
        self.init_calls = 0

    def transfer_backend(self):
        return self.backend

    def tensor_parallel_size(self):
        return 2

    def init_weight_transfer_engine(self, init_info):
        self.init_calls += 1


@pytest.mark.parametrize(
    ("backend", "settings", "message"),
    [
        (None, {}, r"built without a weight-transfer config.*weight_transfer_config=\{'backend': 'gloo'\}"),
        (
            "nccl",
            {"backend": "gloo"},
            "expects weight-transfer backend 'nccl' but this updater uses 'gloo'.*backend='nccl'",
        ),
        ("nccl", {}, r"backend='nccl' sends from the trainer's GPU, but this process has no CUDA device"),
        ("ipc", {"backend": "ipc"}, r"backend='ipc' sends from the trainer's GPU, but this process has no CUDA device"),
        ("gloo", {"vllm_tp_size": 1}, "vllm_tp_size=1 but the engine runs with tensor_parallel_size=2"),
    ],
)
def test_an_engine_not_set_up_for_the_push_is_refused_before_it_is_asked_to_join(backend, settings, message):
    model = tiny_qwen2()
    engine = MisconfiguredEngine(model, backend)
    with pytest.raises(EngineConfigError, match=message):
        EngineConnection.open(engine, source_metadata(ModuleWeights(model)), replace(SETTINGS, **settings))
    assert engine.init_calls == 0


def test_metadata_that_does_not_fit_is_refused_before_joining():
    model = tiny_qwen2()
    engine = MisconfiguredEngine(model, "gloo")
    metadata = source_metadata(ModuleWeights(model))
    metadata["model.norm.weight"] = (torch.float32, torch.Size([64]))
    with pytest.raises(WeightsMismatchError, match=r"tensor 'model.norm.weight' has shape \(64,\)"):
        EngineConnection.open(engine, metadata, SETTINGS)
    assert engine.init_calls == 0


def test_a_push_sends_every_byte_the_engine_loads_and_commits_the_version_it_is_given():
    model = tiny_qwen2(seed=4)
    engine = FakeEngine(model)
    connection = EngineConnection.open(engine, source_metadata(ModuleWeights(model)), SETTINGS)
    connection.check(Payload(ModuleWeights(model)), source_metadata(ModuleWeights(model)))
    pushed = connection.push(Payload(ModuleWeights(model)), version=7)
    assert pushed.num_bytes == sum(p.numel() * 4 for p in model.parameters()) and pushed.version == 7
    timing = pushed.timing  # gloo: the engine loads in the commit, paused around it only
    assert timing.transfer_seconds > 0 and 0 < timing.commit_seconds <= timing.pause_seconds
    assert engine.holds(model) and engine.version == "7"
    # Our trainer engine, the sender itself, is handed each push's weights and client: it keeps what it was built with.
    transfer = connection.sender  # (gloo's: ours)
    assert isinstance(transfer.source, DeclaredWeights) and transfer.client is connection.client
    connection.close()
    assert engine.receiver is None
