"""Rollouts from inside training_step: versions, staleness and its limit."""

from __future__ import annotations

import pytest
from helpers import FakeEngine, TinyCausalLM, cpu_trainer, tensorboard_scalars, tiny_qwen2, token_batches
from vllm import SamplingParams

from lightning_vllm import StaleRolloutsError, VLLMUpdater, VLLMWeightSync, generate
from lightning_vllm.rollouts import RolloutSampler, sampler_of, version_number


class RolloutModule(TinyCausalLM):
    """Samples from vLLM in every training step and records what came back."""

    def __init__(self, versions_ahead: int = 0) -> None:
        super().__init__(tiny_qwen2(seed=0), lr=1e-3)
        self.versions_ahead = versions_ahead
        self.rollouts: list = []
        self.seen: list[tuple[int, str | None, int]] = []

    def training_step(self, batch, batch_idx):
        updater = sampler_of(self).updater
        for _ in range(self.versions_ahead):
            updater.increment_version()  # the trainer counts versions vLLM never got
        rollouts = generate(self, [[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=3, logprobs=0, seed=0))
        self.rollouts.append(rollouts)
        self.seen.append((self.global_step, rollouts[0].weight_version, updater.weight_version))
        return super().training_step(batch, batch_idx)


@pytest.mark.engine
def test_rollouts_carry_the_version_that_produced_them(llm, tmp_path):
    module = RolloutModule()
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, max_staleness=0)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
    trainer.fit(module, token_batches(num_batches=4))
    # Pushes at fit start (v1) and after steps 2 (v2) and 4 (v3); step s samples from the latest.
    assert module.seen == [(0, "1", 1), (1, "1", 1), (2, "2", 2), (3, "2", 2)]
    assert [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/staleness")] == [0.0] * 4
    for rollouts in module.rollouts:
        assert len(rollouts) == 4 and all(len(r.token_ids) == 3 and len(r.logprobs) == 3 for r in rollouts)
        assert [r.prompt_token_ids for r in rollouts] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]


def test_rollouts_older_than_max_staleness_are_refused(tmp_path):
    module = RolloutModule(versions_ahead=2)
    sync = VLLMWeightSync(engine=FakeEngine(module.hf), every_n_train_steps=1, max_staleness=1)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=2)
    message = r"weight version 1 are 2 versions behind the trainer \(version 3\).*max_staleness=1"
    with pytest.raises(StaleRolloutsError, match=message):
        trainer.fit(module, token_batches(num_batches=2))


def test_staleness_is_logged_when_allowed(tmp_path):
    module = RolloutModule(versions_ahead=1)
    sync = VLLMWeightSync(engine=FakeEngine(module.hf), every_n_train_steps=0)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=2)
    trainer.fit(module, token_batches(num_batches=2))
    assert [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/staleness")] == [1.0, 2.0]


def test_the_sampler_keeps_the_oldest_version_until_asked():
    updater = VLLMUpdater()
    sampler = RolloutSampler(updater, max_staleness=None)
    assert sampler.take_staleness() is None
    updater.weight_version = 5
    sampler.record(["5", "3"])
    sampler.record(["4", None])  # None: the engine never reported a version, counted as 0
    assert sampler.take_staleness() == 5
    assert sampler.take_staleness() is None  # forgotten once taken


def test_version_strings_become_numbers():
    assert [version_number(v) for v in ("12", "default", None, "v3")] == [12, 0, 0, 0]


def test_generate_needs_the_callback(tmp_path):
    module = TinyCausalLM(tiny_qwen2())
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        generate(module, [[1, 2]])
    cpu_trainer(tmp_path, [], max_steps=1).fit(module, token_batches(num_batches=1))
    with pytest.raises(RuntimeError, match="0 VLLMWeightSync callbacks"):
        generate(module, [[1, 2]])


def test_a_rank_without_an_engine_cannot_generate():
    with pytest.raises(RuntimeError, match="holds no vLLM engine"):
        VLLMWeightSync().generate([[1, 2]])
