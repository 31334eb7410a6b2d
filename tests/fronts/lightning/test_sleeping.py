"""The callback's ``sleep_level`` and pushes that meet a sleeping engine, on vLLM's CPU build.

vLLM's CPU build refuses ``enable_sleep_mode=True``, and its workers' ``sleep`` and ``wake_up`` free nothing ("not
supported on CPU, ignore it"). Everything around them is vLLM's own: the engine core pauses its scheduler, the
executor keeps its sleeping tags, and our plugin's notes in each worker count the levels and drops. So here a real
engine whose target says it was built with sleep mode (``tests/sleeping_engine.py``) shows the order of calls, the
versions and what is served; the GPU tier (``tests/gpu/test_gpu_sleep.py``) shows the memory.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TinyCausalLM,
    assert_serves,
    cpu_trainer,
    served_version,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
)
from sleeping_engine import sleeping_cpu_engine
from vllm import SamplingParams

from lightning_vllm import EngineConfigError, VLLMUpdater, VLLMWeightSync, generate
from lightning_vllm.engines.sleep import SleepState, WeightsDroppedError

pytestmark = pytest.mark.engine


@pytest.fixture
def sleeping(llm):
    with sleeping_cpu_engine(llm) as engine:
        yield engine


class SleepyRollouts(TinyCausalLM):
    """Samples in every step, then checks that the engine served the weights of the version it says."""

    def __init__(self) -> None:
        super().__init__(tiny_qwen2(seed=3), lr=1e-2)
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        rollouts = generate(self, [[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        self.seen.append((rollouts[0].weight_version, self.trainer.callbacks[0].weight_version))
        return super().training_step(batch, batch_idx)


def test_sleep_level_on_an_engine_built_without_sleep_mode_is_refused_before_any_byte_moves(llm, tmp_path):
    version = served_version(llm)
    sync = VLLMWeightSync(engine=llm, sleep_level=1)
    message = r"enable_sleep_mode=True \(vLLM's CUDA build; its CPU build has no sleep mode.*sleep_level=None"
    with pytest.raises(EngineConfigError, match=message):
        cpu_trainer(tmp_path, [sync], max_steps=1).fit(TinyCausalLM(tiny_qwen2(seed=3)), token_batches(1))
    assert served_version(llm) == version


def test_level_2_sleeps_before_backward_pushes_every_layer_and_pushes_first_when_no_push_was_due(sleeping, tmp_path):
    module = SleepyRollouts()
    sync = VLLMWeightSync(engine=sleeping, sleep_level=2, every_n_train_steps=2, changed_only=True)
    v = served_version(sleeping)
    cpu_trainer(tmp_path, [sync], max_steps=3).fit(module, token_batches(3))
    assert sleeping.calls == [
        f"commit {v + 1}",  # fit start
        "generate",
        "sleep 2",  # step 1's backward; no push due after it
        "wake weights",
        f"commit {v + 2}",  # step 2's rollouts push first: the weights were dropped
        "wake all",
        "generate",
        "sleep 2",
        "wake weights",
        f"commit {v + 3}",  # step 2's push point
        "wake all",
        "generate",
        "sleep 2",  # step 3; the fit ends with the weights dropped, the engine asleep
    ]
    assert module.seen == [(v + 1, v + 1), (v + 2, v + 2), (v + 3, v + 3)]
    # Each push after a drop sent every layer: the engine serves the trainer's weights of then, which step 3 left.
    assert sleeping.sleep_state() == SleepState(
        frozenset({"weights", "kv_cache"}), 2, sleeping.dropped_at_last_push + 1
    )
    with pytest.raises(WeightsDroppedError, match=r"dropped its weights .* Push the weights first"):
        sync.generate([[1, 2]])  # (after the fit: nothing pushes first)


def test_level_1_sleeps_before_backward_and_a_push_point_wakes_only_the_weights(sleeping, tmp_path):
    module = SleepyRollouts()
    sync = VLLMWeightSync(engine=sleeping, sleep_level=1, every_n_train_steps=1)
    v = served_version(sleeping)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=2)
    trainer.fit(module, token_batches(2))
    step = ["sleep 1", "wake weights"]
    assert sleeping.calls == [
        f"commit {v + 1}", "generate", *step, f"commit {v + 2}", "wake all", "generate", *step, f"commit {v + 3}",
        "wake all",  # the fit ends: awake, serving the last push
    ]  # fmt: skip
    assert module.seen == [(v + 1, v + 1), (v + 2, v + 2)]
    assert not sleeping.sleep_state().asleep
    assert_serves(sleeping.llm, module.hf)
    slept = tensorboard_scalars(trainer.logger.log_dir, "vllm/sleep_seconds")
    assert [step for step, _ in slept] == [0, 1] and all(seconds > 0 for _, seconds in slept)


def pushed_once(engine, seed: int) -> tuple[VLLMUpdater, torch.nn.Module, int]:
    """A changed-only updater of ``engine`` that pushed a model once: it, the model, and the bytes of a full push."""
    updater = VLLMUpdater(engine=engine, changed_only=True)
    model = tiny_qwen2(seed=seed)
    updater.push_weights(model)
    return updater, model, updater.last_sync.num_bytes


def write_one_layer(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    return model


def test_a_push_into_an_engine_the_user_put_to_sleep_wakes_its_weights_first(sleeping):
    updater, model, full_bytes = pushed_once(sleeping, seed=4)
    sleeping.llm.sleep(level=1)
    updater.push_weights(write_one_layer(model))
    assert updater.last_sync.num_bytes < full_bytes  # level 1 kept the rest
    assert sleeping.calls[-3:] == ["wake weights", f"commit {updater.weight_version}", "sleep 1"]  # back to level 1
    assert sleeping.sleep_state().weights_asleep

    sleeping.llm.wake_up()
    sleeping.llm.sleep(level=2)
    updater.push_weights(write_one_layer(model))
    assert updater.last_sync.num_bytes == full_bytes  # level 2 dropped the rest: every layer again
    assert sleeping.calls[-2:] == ["wake weights", f"commit {updater.weight_version}"]
    assert sleeping.sleep_state().asleep == {"kv_cache"}  # the weights awake, the KV cache for the rollouts

    sleeping.wake_up(None)
    assert_serves(sleeping.llm, model)


def test_the_users_own_level_2_sleep_and_wake_is_noticed(sleeping):
    updater, model, full_bytes = pushed_once(sleeping, seed=5)
    sleeping.llm.sleep(level=2)
    sleeping.llm.wake_up()  # vLLM reports the last version, and serves whatever the woken memory holds
    with pytest.raises(WeightsDroppedError, match="dropped its weights"):
        VLLMWeightSync(updater=updater).rollouts.generate([[1, 2]])
    updater.push_weights(write_one_layer(model))
    assert updater.last_sync.num_bytes == full_bytes
    assert_serves(sleeping.llm, model)


def test_level_2_with_background_changed_only_pushes_and_a_frozen_embedding_samples_each_version_it_says(
    sleeping, tmp_path
):
    module = SleepyRollouts()
    module.hf.model.embed_tokens.weight.requires_grad_(False)
    sync = VLLMWeightSync(engine=sleeping, sleep_level=2, every_n_train_steps=2, blocking=False, changed_only=True)
    v = served_version(sleeping)
    cpu_trainer(tmp_path, [sync], max_steps=4).fit(module, token_batches(4))
    # Steps 2 and 4 push first (blocking: the weights were dropped); step 2's push point goes in the background,
    # and step 3's rollouts wait for it (the weights it refills were dropped), so every step samples the latest.
    assert module.seen == [(v + 1, v + 1), (v + 2, v + 2), (v + 3, v + 3), (v + 4, v + 4)]
    assert sync.weight_version == v + 5  # step 4's push point, landed at the end of the fit
    assert sleeping.calls.count("sleep 2") == 4
    assert sleeping.dropped_at_last_push == sleeping.sleep_state().dropped  # the last push refilled the last drop
    sleeping.wake_up(None)
    assert_serves(sleeping.llm, module.hf)
