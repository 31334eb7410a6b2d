"""TorchRL's updater puts its engines to sleep for training's turn and wakes them for the collector's (on vLLM's CPU
build, whose workers' sleeps free nothing: ``tests/sleeping_engine.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_serves, tiny_qwen2
from sleeping_engine import sleeping_cpu_engine

from lightning_vllm import VLLMUpdater
from lightning_vllm.engines.sleep import WeightsDroppedError


def test_sleep_needs_a_level():
    with pytest.raises(ValueError, match="pass sleep_level=1 or 2 to VLLMUpdater"):
        VLLMUpdater().sleep()


@pytest.mark.engine
def test_the_updater_sleeps_its_engines_a_push_wakes_the_weights_and_wake_up_the_rest(llm):
    with sleeping_cpu_engine(llm) as engine:
        updater = VLLMUpdater(engine=engine, sleep_level=2, changed_only=True)
        model = tiny_qwen2(seed=6)
        updater.push_weights(model)
        full_bytes = updater.last_sync.num_bytes
        updater.sleep()
        with pytest.raises(WeightsDroppedError):
            updater.wake_up()  # (nothing to sample from before a push)
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
        updater.push_weights(model)
        assert updater.last_sync.num_bytes == full_bytes
        assert engine.sleep_state().asleep == {"kv_cache"}  # sleep_level set: the weights stay awake
        updater.wake_up()
        assert engine.calls[-4:] == ["sleep 2", "wake weights", f"commit {updater.weight_version}", "wake all"]
        assert not engine.sleep_state().asleep
        assert_serves(llm, model)
