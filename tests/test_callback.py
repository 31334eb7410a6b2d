"""The Lightning callback, end to end: a real Trainer pushes into a real vLLM engine."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    TinyCausalLM,
    cpu_trainer,
    hf_greedy,
    hf_prompt_logprobs,
    max_abs_diff,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
    vllm_greedy,
    vllm_prompt_logprobs,
)

from lightning_vllm import VLLMWeightSync

TOLERANCE = 1e-4


def test_training_run_keeps_vllm_on_the_trained_weights(llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    served_before = vllm_prompt_logprobs(llm)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=60)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=6)

    trainer.fit(module, token_batches(num_batches=6))

    module.hf.eval()
    trained = hf_prompt_logprobs(module.hf)
    # The test can fail: training moved the weights away from what vLLM served before.
    assert max_abs_diff(served_before, trained) > 1e-2
    served_after = vllm_prompt_logprobs(llm)
    assert max_abs_diff(served_after, trained) < TOLERANCE
    assert vllm_greedy(llm) == hf_greedy(module.hf)
    # Fit start, then steps 2, 4 and 6.
    assert sync.weight_version == 4
    assert llm.get_weight_version() == "4"
    logged = tensorboard_scalars(trainer.logger.log_dir, "vllm/weight_version")
    assert logged == [(0, 1.0), (2, 2.0), (4, 3.0), (6, 4.0)]
    sync_seconds = tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_seconds")
    sync_bytes = tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_bytes")
    assert len(sync_seconds) == 4 and all(seconds > 0 for _, seconds in sync_seconds)
    num_bytes = sum(p.numel() * p.element_size() for p in module.hf.parameters())
    assert [value for _, value in sync_bytes] == [float(num_bytes)] * 4


def test_pushes_follow_optimizer_steps_under_gradient_accumulation(llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, push_on_fit_start=False)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4, accumulate_grad_batches=3)

    trainer.fit(module, token_batches(num_batches=12))

    # 12 batches, 4 optimizer steps: pushes at steps 2 and 4 only, once each.
    assert sync.weight_version == 2
    assert [step for step, _ in tensorboard_scalars(trainer.logger.log_dir, "vllm/weight_version")] == [2, 4]
    module.hf.eval()
    assert max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(module.hf)) < TOLERANCE


def test_a_resumed_run_continues_counting_versions(llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    first = VLLMWeightSync(engine=llm, every_n_train_steps=2)
    trainer = cpu_trainer(tmp_path, [first], max_steps=2)
    trainer.fit(module, token_batches(num_batches=4))
    checkpoint = tmp_path / "run.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert first.weight_version == 2

    resumed = VLLMWeightSync(engine=llm, every_n_train_steps=2)
    trainer = cpu_trainer(tmp_path, [resumed], max_steps=4)
    trainer.fit(copy.deepcopy(module), token_batches(num_batches=4), ckpt_path=checkpoint)

    # Restored version 2, then a push at fit start (3) and at step 4 (4).
    assert resumed.weight_version == 4
    assert llm.get_weight_version() == "4"


def test_the_hf_model_can_live_under_any_attribute(llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=3), attribute="policy")
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1)
    cpu_trainer(tmp_path, [sync], max_steps=1).fit(module, token_batches(num_batches=1))
    module.hf.eval()
    assert max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(module.hf)) < TOLERANCE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_train_steps": -1}, "every_n_train_steps=-1"),
        ({"every_n_epochs": -2}, "every_n_epochs=-2"),
        ({"backend": "tcp"}, "backend='tcp'"),
        ({"timeout_seconds": 0}, "timeout_seconds=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMWeightSync(**kwargs)


def test_rank_zero_without_an_engine_fails_at_setup(tmp_path):
    sync = VLLMWeightSync(engine=None)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=1)
    with pytest.raises(ValueError, match="no vLLM engine"):
        trainer.fit(TinyCausalLM(tiny_qwen2()), token_batches(num_batches=1))


def test_state_dict_round_trip_reads_old_checkpoints():
    sync = VLLMWeightSync()
    sync.load_state_dict({})  # a checkpoint written before these keys existed
    assert sync.weight_version == 0
    sync.load_state_dict({"weight_version": 7, "last_global_step_pushed": 14})
    assert sync.state_dict() == {"weight_version": 7, "last_global_step_pushed": 14}
    assert isinstance(torch.tensor(sync.weight_version), torch.Tensor)


class FailingCausalLM(TinyCausalLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_training_releases_the_group(llm, tmp_path):
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(FailingCausalLM(tiny_qwen2(seed=0)), token_batches(num_batches=4))
    assert sync.weight_version == 2  # fit start and step 1
    assert not sync.updater.initialized
