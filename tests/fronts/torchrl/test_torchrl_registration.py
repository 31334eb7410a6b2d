"""TorchRL's collectors take our updater: registration, the call signature, one policy version
per push, and the engine found through the collector. Real TorchRL collectors, pushing over
real gloo into the fake engine (TorchRL's LLM collector with real vLLM: tests/engines/test_torchrl.py).
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import types

import pytest
import torch
from helpers import FakeEngine, tiny_qwen2

from lightning_vllm import EngineConfigError, VLLMUpdater, WeightsMismatchError, vLLMUpdater
from lightning_vllm.fronts.torchrl.collectors import register_with_torchrl, torchrl_updater_base

torchrl = pytest.importorskip("torchrl", reason="the torchrl extra (make test installs it)")


def test_an_updater_is_a_torchrl_weight_updater():
    from torchrl.collectors import WeightUpdaterBase

    assert isinstance(vLLMUpdater(), WeightUpdaterBase)
    assert issubclass(VLLMUpdater, WeightUpdaterBase)


def test_the_call_has_torchrl_signature():
    from torchrl.collectors import WeightUpdaterBase

    ours = inspect.signature(VLLMUpdater.__call__).parameters
    theirs = inspect.signature(WeightUpdaterBase.__call__).parameters
    assert list(ours) == list(theirs) == ["self", "policy_or_weights", "worker_ids"]
    assert all(ours[name].default is None for name in ("policy_or_weights", "worker_ids"))


def test_without_torchrl_nothing_is_registered(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchrl" else find_spec(name, *a)
    )
    torchrl_updater_base.cache_clear()
    try:
        assert torchrl_updater_base() is None

        class Mine:  # (a subclass of VLLMUpdater would inherit the earlier registration)
            pass

        register_with_torchrl(Mine)  # no torchrl: nothing happens, nothing fails
        from torchrl.collectors import WeightUpdaterBase

        assert not issubclass(Mine, WeightUpdaterBase)
    finally:
        torchrl_updater_base.cache_clear()


def test_a_torchrl_that_does_not_import_is_named_and_pushes_still_work(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torchrl.collectors", None)  # `from torchrl.collectors import ...` fails
    torchrl_updater_base.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_vllm.fronts.torchrl.updater"):
            assert torchrl_updater_base() is None
        assert "torchrl is installed but does not import" in caplog.text
        assert "docs/torchrl.md" in caplog.text
    finally:
        torchrl_updater_base.cache_clear()


@pytest.mark.engine  # no engine, but a fresh interpreter importing vLLM takes ~7 s: kept out of the fast tier
def test_importing_the_package_does_not_import_torchrl():
    """vLLM imports the package in each of its processes (the transport plugin): no torchrl there."""
    code = "import sys, lightning_vllm; sys.exit('torchrl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.fixture
def collector_and_engine():
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import Collector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    env = ContinuousActionVecMockEnv()
    layer = torch.nn.Linear(env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1])
    policy = TensorDictModule(layer, in_keys=["observation"], out_keys=["action"])
    model = tiny_qwen2()
    engine = FakeEngine(model)
    updater = vLLMUpdater(engine=engine)
    collector = Collector(
        env, policy, frames_per_batch=2, total_frames=-1, weight_updater=updater, track_policy_version=True
    )
    yield collector, updater, engine, model
    updater.close()
    collector.shutdown()


def test_a_torchrl_collector_counts_one_version_per_push(collector_and_engine):
    collector, updater, engine, model = collector_and_engine
    assert updater.collector is collector and updater.collectors == [collector]
    assert collector.policy_version == 0
    collector.init_updater(vLLMUpdater.get_model_metadata(model))  # TorchRL's way to call updater.init
    assert updater.initialized and collector.policy_version == 0

    collector.update_policy_weights_(model)  # the collector counts this one itself
    assert collector.policy_version == 1 and engine.holds(model) and engine.version == "1"
    collector.update_policy_weights_(policy_or_weights=model, worker_ids=[0])
    assert collector.policy_version == 2
    updater(model)  # directly: the updater counts it
    updater.push_weights(model)
    assert collector.policy_version == 4 and updater.weight_version == 4 and engine.num_updates == 4

    batch = next(iter(collector))  # each step is tagged with the version it was taken under
    assert batch["next", "policy_version"].unique().tolist() == [4]


def test_a_refused_push_counts_no_version(collector_and_engine):
    collector, updater, engine, model = collector_and_engine
    collector.update_policy_weights_(model)
    wrong = {name: tensor for name, tensor in model.state_dict().items() if "layers.1." not in name}
    with pytest.raises(WeightsMismatchError):
        collector.update_policy_weights_(wrong)
    with pytest.raises(WeightsMismatchError):
        updater(wrong)
    assert collector.policy_version == 1 and engine.num_updates == 1


class CountingContainer:
    """A collector whose ``update_policy_weights_`` calls the updater and, if ``counts``, bumps
    its own version after it (TorchRL's single-process collectors do; its multi-process ones do not)."""

    def __init__(self, updater, counts: bool) -> None:
        self.counts = counts
        self.policy_version = 0
        self.weight_updater = updater
        updater.register_collector(self)

    def increment_version(self) -> None:
        self.policy_version += 1

    def update_policy_weights_(self, policy_or_weights=None, *, worker_ids=None) -> None:
        self.weight_updater(policy_or_weights=policy_or_weights, worker_ids=worker_ids)
        if self.counts:
            self.increment_version()


@pytest.mark.parametrize("counts", [True, False], ids=["collector_counts", "collector_does_not_count"])
def test_one_version_per_push_whoever_counts(counts):
    model = tiny_qwen2()
    updater = vLLMUpdater(engine=FakeEngine(model))
    container = CountingContainer(updater, counts)
    try:
        container.update_policy_weights_(model)
        assert container.policy_version == 1
        updater(model)
        assert container.policy_version == 2
        with pytest.raises(ValueError, match="push_weights needs the weights"):
            container.update_policy_weights_()
        assert container.policy_version == 2
        updater.increment_version()  # no push: both counters move, as with TorchRL's updaters
        assert container.policy_version == 3 and updater.weight_version == 3
    finally:
        updater.close()


class Holder:
    """A container with a policy (weak-referenceable, as collectors are)."""

    def __init__(self, engine) -> None:
        self.policy = types.SimpleNamespace(model=engine)


def test_without_an_engine_the_updater_pushes_to_the_collector_policys():
    model = tiny_qwen2()
    engine = FakeEngine(model)
    updater = vLLMUpdater(model_metadata=vLLMUpdater.get_model_metadata(model))
    container = Holder(engine)
    updater.register_collector(container)
    try:
        updater.push_weights(model)
        assert engine.holds(model) and updater.engine is engine
    finally:
        updater.close()


def test_a_collector_policy_on_an_engine_we_cannot_push_to_is_named():
    updater = vLLMUpdater()
    container = Holder(object())
    updater.register_collector(container)
    with pytest.raises(EngineConfigError, match="generates with a object, which this updater cannot push to"):
        updater.push_weights(tiny_qwen2())
