"""Everything a user does with an in-process ``vllm.LLM`` on one GPU over vLLM's ipc backend, on vLLM's own
engine: ``Trainer.fit`` with ``VLLMWeightSync``, rollouts during training, background and changed-only
pushes, LoRA, a push that fails half way, 100 pushes, and the engine core killed mid-push (last: it
ends the shared engine)."""

from __future__ import annotations

import time

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    engine_gpu_memory,
    fit_lands_within_the_floor,
    gpu_trainer,
    hf_greedy,
    hf_prompt_logprobs,
    push_killed_half_way,
)
from helpers import (
    PROMPTS,
    TinyCausalLM,
    half_way,
    lora_policy,
    max_abs_diff,
    raises,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
    vllm_greedy,
    vllm_prompt_logprobs,
)

from lightning_vllm import (
    EngineConfigError,
    VLLMUpdater,
    VLLMWeightSync,
    WeightSyncTimeoutError,
    generate,
)
from lightning_vllm.engines.base import version_number

pytestmark = pytest.mark.gpu


def serves(llm, model: torch.nn.Module, bound: float = 2 * 2.0e-4) -> float:
    """The prompt-logprob gap between the engine and ``model``; fails above ``bound`` or on other greedy tokens."""
    measured = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(model))
    assert measured <= bound, f"served logprobs are {measured:.2e} from the model's (bound {bound:.1e})"
    assert vllm_greedy(llm) == hf_greedy(model)
    return measured


def test_fit_pushes_land_within_the_engines_own_float32_floor(ipc_llm, tmp_path):
    trainer, version = fit_lands_within_the_floor(ipc_llm, tmp_path)
    versions = [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/weight_version")]
    assert versions == [version + 1.0, version + 2.0, version + 3.0]
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_seconds")) == 3
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_bytes")) == 3


class RolloutPolicy(TinyCausalLM):
    """Samples rollouts in every training step, through the callback's engine, and keeps them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, lr=1e-2)
        self.rollouts: list[tuple[int, list]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams

        sync = next(c for c in self.trainer.callbacks if isinstance(c, VLLMWeightSync))
        rollouts = generate(self, PROMPTS[:2], SamplingParams(n=2, max_tokens=6, logprobs=0, temperature=1.0))
        self.rollouts.append((sync.weight_version, rollouts))
        return super().training_step(batch, batch_idx)


def test_rollouts_in_training_step_carry_the_version_that_produced_them(ipc_llm, tmp_path):
    module = RolloutPolicy(tiny_qwen2(seed=2))
    sync = VLLMWeightSync(engine=ipc_llm, every_n_train_steps=1)
    start = version_number(ipc_llm.get_weight_version())

    gpu_trainer(tmp_path, [sync], max_steps=3).fit(module, token_batches(num_batches=3))

    assert [committed for committed, _ in module.rollouts] == [start + 1, start + 2, start + 3]
    for committed, rollouts in module.rollouts:
        assert len(rollouts) == 4  # 2 prompts, 2 samples each
        for rollout in rollouts:
            assert rollout.weight_version == committed and rollout.weight_version_exact
            assert len(rollout.token_ids) == 6 and len(rollout.logprobs) == 6
            assert all(logprob <= 0.0 for logprob in rollout.logprobs)
    serves(ipc_llm, module.hf)


def test_background_pushes_land_and_the_last_is_served(ipc_llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=3), lr=1e-2)
    sync = VLLMWeightSync(engine=ipc_llm, every_n_train_steps=1, blocking=False, when_busy="wait")
    start = version_number(ipc_llm.get_weight_version())

    trainer = gpu_trainer(tmp_path, [sync], max_steps=3)
    trainer.fit(module, token_batches(num_batches=3))

    assert ipc_llm.get_weight_version() == str(sync.weight_version) == str(start + 4)  # fit start + 3 steps
    serves(ipc_llm, module.hf)
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_stall_seconds")) == 4
    assert sync.pusher is not None and sync.pusher.memory.where == "device"  # the snapshots stayed on the GPU


def test_changed_only_leaves_a_frozen_embedding_out(ipc_llm, tmp_path):
    model = tiny_qwen2(seed=4)
    model.model.embed_tokens.weight.requires_grad_(False)
    module = TinyCausalLM(model, lr=1e-2)
    sync = VLLMWeightSync(engine=ipc_llm, every_n_train_steps=1)

    trainer = gpu_trainer(tmp_path, [sync], max_steps=2)
    trainer.fit(module, token_batches(num_batches=2))

    sent = [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_bytes")]
    embedding = model.model.embed_tokens.weight.numel() * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert sent == [total, total - embedding, total - embedding]  # fit start sends it once
    serves(ipc_llm, module.hf)


def test_lora_policies_go_merged_over_ipc_and_their_adapter_alone_is_refused_before_a_byte_moves(ipc_llm, tmp_path):
    policy = lora_policy(seed=5)
    module = TinyCausalLM(policy, lr=1e-2)
    sync = VLLMWeightSync(engine=ipc_llm, every_n_train_steps=1)  # lora="auto"
    gpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))
    policy.eval()
    serves(ipc_llm, policy)  # the PEFT model's outputs: base plus adapter, merged
    with policy.disable_adapter():
        assert max_abs_diff(vllm_prompt_logprobs(ipc_llm), hf_prompt_logprobs(policy)) > 1e-2  # (the test can fail)

    version = ipc_llm.get_weight_version()
    updater = VLLMUpdater(engine=ipc_llm, lora="adapter")
    with pytest.raises(EngineConfigError, match="adapter pushes need the gloo backend"):
        updater.push_weights(policy)
    assert ipc_llm.get_weight_version() == version
    updater.close()


def test_a_push_that_fails_half_way_leaves_the_engine_serving_and_the_next_push_lands(ipc_llm):
    model = tiny_qwen2(seed=6).cuda()
    updater = VLLMUpdater(engine=ipc_llm, timeout_seconds=60, bucket_size_bytes=1 << 20)  # several chunks
    updater.push_weights(model)
    version = ipc_llm.get_weight_version()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)

    with pytest.raises(RuntimeError, match="could not be read half way"):
        updater.push_weights(half_way(model, raises(RuntimeError("the policy could not be read half way"))))

    assert ipc_llm.get_weight_version() == version  # not committed
    vllm_prompt_logprobs(ipc_llm)  # the engine still generates: the update was closed, no layer left on meta
    updater.push_weights(model)  # the same engine, no restart
    assert int(ipc_llm.get_weight_version()) == int(version) + 1
    serves(ipc_llm, model)
    updater.close()


def test_a_push_that_times_out_half_way_leaves_the_engine_serving_and_the_next_push_lands(ipc_llm):
    model = tiny_qwen2(seed=9).cuda()
    updater = VLLMUpdater(engine=ipc_llm, timeout_seconds=5, bucket_size_bytes=1 << 20)
    updater.push_weights(model)
    version = ipc_llm.get_weight_version()
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError):
        updater.push_weights(half_way(model, lambda: time.sleep(8)))  # stalls past the timeout
    FIGURES.update(timeout_error_seconds=time.monotonic() - started)
    assert time.monotonic() - started < 7
    assert ipc_llm.get_weight_version() == version  # not committed
    vllm_prompt_logprobs(ipc_llm)  # the engine generates
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    updater.push_weights(model)  # lands, although the stalled transfer wakes up in the middle of it
    time.sleep(4)
    assert int(ipc_llm.get_weight_version()) == int(version) + 1
    serves(ipc_llm, model)
    updater.close()


def test_a_hundred_pushes_leave_gpu_memory_flat_on_both_sides(ipc_llm):
    model = tiny_qwen2(seed=7).cuda()
    updater = VLLMUpdater(engine=ipc_llm, timeout_seconds=60)
    for _ in range(10):  # warm-up: buffers and caches reach their size
        updater.push_weights(model)
    trainer, engine = [], []  # (allocated, reserved) after each push
    started = time.perf_counter()
    for step in range(100):
        with torch.no_grad():
            model.lm_head.weight.add_(1e-4 * ((-1) ** step))
        updater.push_weights(model)
        torch.cuda.synchronize()
        trainer.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        if step % 10 == 9:
            engine.append(engine_gpu_memory(ipc_llm))
    seconds = time.perf_counter() - started

    # Flat: the second half never holds more than the first (a leak of a buffer or a handle per push would).
    # The trainer's reserved memory swings by one packed buffer: one stays shared with the worker until
    # torch's IPC reference counting lets the caching allocator reuse it.
    def growth(samples: list[tuple[int, int]], i: int) -> int:
        half = len(samples) // 2
        return max(v[i] for v in samples[half:]) - max(v[i] for v in samples[:half])

    growths = {
        f"{side}_{kind}_growth": growth(samples, i)
        for side, samples in (("trainer", trainer), ("engine", engine))
        for i, kind in enumerate(("allocated", "reserved"))
    }
    swing = max(r for _, r in trainer) - min(r for _, r in trainer)
    FIGURES.update(soak_pushes=100, soak_seconds_per_push=seconds / 100, trainer_reserved_swing=swing, **growths)
    assert all(value <= 0 for value in growths.values()), growths
    serves(ipc_llm, model)
    updater.close()


def test_the_engine_core_killed_mid_push_is_an_error_within_the_timeout(ipc_llm):
    timeout = 20.0
    error, elapsed = push_killed_half_way(ipc_llm, timeout)
    FIGURES.update(kill_error_seconds=elapsed)
    print(f"engine core killed mid-push: {type(error).__name__} after {elapsed:.1f} s: {error}")
    assert elapsed < timeout + 5
    torch.ones(1, device="cuda").add_(1)  # the trainer's GPU still answers
    torch.cuda.synchronize()
