"""The TorchRL vLLMUpdater surface: every name users know, with its behaviour."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch
from helpers import TinyCausalLM, tiny_qwen2

from lightning_vllm import EngineConfigError, VLLMUpdater

# torchrl.collectors.llm.vLLMUpdater: method -> parameter names (self/cls excluded).
REFERENCE = {
    "__init__": ["master_address", "master_port", "model_metadata", "vllm_tp_size"],
    "init": ["model_metadata"],
    "push_weights": ["policy_or_weights", "worker_ids"],
    "_sync_weights_with_worker": ["worker_id", "server_weights"],
    "_get_server_weights": [],
    "_maybe_map_weights": ["server_weights"],
    "_skip_update": ["worker_id"],
    "all_worker_ids": [],
    "from_policy": ["policy"],
    "get_model_metadata": ["model"],
    "increment_version": [],
    "register_post_hook": ["hook"],
    "register_collector": ["collector"],
}


@pytest.mark.parametrize(("method", "parameters"), REFERENCE.items())
def test_every_reference_name_and_parameter_exists(method, parameters):
    signature = inspect.signature(getattr(VLLMUpdater, method))
    names = [name for name in signature.parameters if name not in ("self", "cls")]
    assert names[: len(parameters)] == parameters
    # Anything we add comes after the reference parameters and has a default.
    for extra in names[len(parameters) :]:
        assert signature.parameters[extra].default is not inspect.Parameter.empty


def test_reference_properties_exist():
    updater = VLLMUpdater()
    assert updater.post_hooks == [] and updater.collector is None
    assert isinstance(inspect.getattr_static(VLLMUpdater, "post_hooks"), property)
    assert isinstance(inspect.getattr_static(VLLMUpdater, "collector"), property)


def test_constructor_defaults_follow_torchrl():
    updater = VLLMUpdater()
    assert updater.master_address == "127.0.0.1" and updater.master_port is None
    assert updater.model_metadata is None and updater.vllm_tp_size is None
    metadata = {"w": (torch.float32, [2, 3])}
    assert VLLMUpdater(model_metadata=metadata).model_metadata == {"w": (torch.float32, torch.Size([2, 3]))}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"master_port": 70000}, "master_port=70000"),
        ({"vllm_tp_size": 0}, "vllm_tp_size=0"),
        ({"bucket_size_bytes": 10}, "bucket_size_bytes=10"),
        ({"backend": "rdma"}, "backend='rdma'"),
    ],
)
def test_bad_constructor_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMUpdater(**kwargs)


def test_from_policy_serves_modules_holding_a_hf_model_only():
    updater = VLLMUpdater.from_policy(TinyCausalLM(tiny_qwen2(), attribute="actor"))
    assert isinstance(updater, VLLMUpdater)
    assert updater.model_metadata == VLLMUpdater.get_model_metadata(tiny_qwen2())
    assert VLLMUpdater.from_policy(torch.nn.Module()) is not None  # a plain module: sent as it is named
    assert VLLMUpdater.from_policy("not a module") is None
    assert VLLMUpdater.from_policy(TinyCausalLM(torch.nn.Linear(2, 2))) is None


def test_get_model_metadata_accepts_everything_push_weights_does():
    model = tiny_qwen2()
    from_model = VLLMUpdater.get_model_metadata(model)
    assert VLLMUpdater.get_model_metadata(TinyCausalLM(model)) == from_model
    assert VLLMUpdater.get_model_metadata(dict(model.named_parameters())) == from_model


def test_get_server_weights_refuses_to_push_nothing():
    with pytest.raises(ValueError, match="push_weights needs the weights"):
        VLLMUpdater()._get_server_weights()
    with pytest.raises(ValueError, match="push_weights needs the weights"):
        VLLMUpdater().push_weights()


def test_maybe_map_weights_names_what_it_cannot_send():
    with pytest.raises(TypeError, match="Cannot push weights from a int"):
        VLLMUpdater()._maybe_map_weights(3)


def test_increment_version_counts_without_pushing():
    updater = VLLMUpdater()
    updater.increment_version()
    updater.increment_version()
    assert updater.weight_version == 2


def test_post_hooks_must_be_callable():
    with pytest.raises(TypeError, match="must be callable"):
        VLLMUpdater().register_post_hook("not callable")  # type: ignore[arg-type]


class Collector:
    def __init__(self) -> None:
        self.versions = 0

    def increment_version(self) -> None:
        self.versions += 1


def test_a_collector_registers_once_and_is_held_weakly():
    updater = VLLMUpdater()
    collector = Collector()
    updater.register_collector(collector)
    assert updater.collector is collector
    with pytest.raises(RuntimeError, match="Cannot register collector twice"):
        updater.register_collector(Collector())
    assert len(updater.post_hooks) == 1
    updater.post_hooks[0]()
    assert collector.versions == 1
    del collector
    gc.collect()
    assert updater.collector is None
    updater.post_hooks[0]()  # the collector is gone: the hook does nothing


def test_no_worker_without_an_engine():
    assert VLLMUpdater().all_worker_ids() == []


def test_maybe_map_weights_turns_every_accepted_form_into_a_source():
    from vllm.distributed.weight_transfer.base import WeightSource

    model = tiny_qwen2()
    for weights in (model, TinyCausalLM(model), dict(model.named_parameters())):
        source = VLLMUpdater()._maybe_map_weights(weights)
        assert isinstance(source, WeightSource)
        assert [meta.name for meta in source.metadata()] == [name for name, _ in model.named_parameters()]


def test_sync_with_a_worker_is_a_push_like_any_other():
    with pytest.raises(EngineConfigError, match="No vLLM engine to push to"):
        VLLMUpdater()._sync_weights_with_worker(server_weights=tiny_qwen2())
    with pytest.raises(ValueError, match="version=5 cannot be committed: the next weight version is 1"):
        VLLMUpdater()._sync_weights_with_worker(server_weights=tiny_qwen2(), version=5)
    with pytest.raises(ValueError, match="push_weights needs the weights"):
        VLLMUpdater()._sync_weights_with_worker()


def test_calling_the_updater_pushes():
    with pytest.raises(ValueError, match="push_weights needs the weights"):
        VLLMUpdater()()
