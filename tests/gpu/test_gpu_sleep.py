"""Sleep mode on vLLM's own engine on one GPU (``make test-gpu-sleep``, a call of its own): the callback's
``sleep_level`` over ``lightning_ipc`` and ``ipc``, pushes into engines the user put to sleep, and the memory each
sleep gives the trainer. vLLM's CuMem allocator (its ``cumem_allocator.abi3.so``, which ``.gpu-carry`` keeps) does
the sleeping; the CPU tier (``tests/fronts/lightning/test_sleeping.py``) shows the order of calls."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    digests_equal,
    engine_core_pid,
    engine_digest,
    gpu_llm,
    gpu_trainer,
    hf_greedy,
    hf_prompt_logprobs,
    model_digest,
    stop_llm,
)
from helpers import TinyCausalLM, max_abs_diff, tiny_qwen2, token_batches, vllm_greedy, vllm_prompt_logprobs
from lightning.pytorch.callbacks import Callback
from vllm import SamplingParams

from lightning_vllm import VLLMUpdater, VLLMWeightSync, generate
from lightning_vllm.engines.sleep import WeightsDroppedError

pytestmark = pytest.mark.gpu

BOUND = 2 * 2.0e-4  # twice the engine's float32 floor on the H200 (gpu_helpers.what_it_serves)


@pytest.fixture(scope="module", params=["lightning_ipc", "ipc"])
def sleepy_llm(request, gpu_model_dir, insecure_serialization):
    llm = gpu_llm(gpu_model_dir, backend=request.param, enable_sleep_mode=True)
    yield request.param, llm
    stop_llm(llm)


class Rollouts(TinyCausalLM):
    """Samples in every step; records the version the rollouts say and the trainer's, and the GPU's free memory with
    the engine awake (after the rollouts)."""

    def __init__(self, seed: int) -> None:
        super().__init__(tiny_qwen2(seed=seed), lr=1e-2)
        self.seen: list[tuple[int, int]] = []
        self.free_awake: list[int] = []

    def training_step(self, batch, batch_idx):
        rollouts = generate(self, [[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        self.seen.append((rollouts[0].weight_version, self.trainer.callbacks[0].weight_version))
        torch.cuda.synchronize()
        self.free_awake.append(torch.cuda.mem_get_info()[0])
        return super().training_step(batch, batch_idx)


class FreeAtBackward(Callback):
    """The GPU's free memory at backward, after ``VLLMWeightSync`` (listed first) put the engine to sleep."""

    def __init__(self) -> None:
        self.free: list[int] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        torch.cuda.synchronize()
        self.free.append(torch.cuda.mem_get_info()[0])


def serves(llm: Any, model: torch.nn.Module) -> None:
    """``llm`` serves ``model``: every weight exactly, prompt logprobs within the floor, the same greedy tokens."""
    assert digests_equal(engine_digest(llm), model_digest(model))
    gap = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(model))
    assert gap <= BOUND, gap
    assert vllm_greedy(llm) == hf_greedy(model)
    model.cpu()


@pytest.mark.parametrize("level", [1, 2])
def test_a_fit_sleeps_the_engine_at_each_backward_and_samples_every_pushed_version(sleepy_llm, level, tmp_path):
    backend, llm = sleepy_llm
    module, memory = Rollouts(seed=70 + level), FreeAtBackward()
    sync = VLLMWeightSync(engine=llm, sleep_level=level, every_n_train_steps=1, timeout_seconds=120)
    gpu_trainer(tmp_path, [sync, memory], max_steps=4).fit(module, token_batches(4))
    version = sync.weight_version
    assert module.seen == [(version - 4 + step, version - 4 + step) for step in range(4)]
    freed = [asleep - awake for asleep, awake in zip(memory.free, module.free_awake)]
    FIGURES[f"sleep_{backend}_level{level}_freed_mib"] = [value >> 20 for value in freed]
    assert min(freed) > 1 << 30, freed  # its KV cache (about 4 GiB here) and its weights went to the trainer
    serves(llm, module.hf)


def test_level_2_with_background_changed_only_pushes_and_a_frozen_embedding(sleepy_llm, tmp_path):
    backend, llm = sleepy_llm
    module = Rollouts(seed=75)
    module.hf.model.embed_tokens.weight.requires_grad_(False)
    sync = VLLMWeightSync(
        engine=llm, sleep_level=2, every_n_train_steps=2, blocking=False, changed_only=True, timeout_seconds=120
    )
    gpu_trainer(tmp_path, [sync], max_steps=4).fit(module, token_batches(4))
    assert [seen for seen, trainer in module.seen] == [trainer for _, trainer in module.seen]
    serves(llm, module.hf)


@pytest.mark.parametrize("level", [1, 2])
def test_a_push_into_an_engine_the_user_put_to_sleep_lands_and_the_engine_core_lives(sleepy_llm, level):
    backend, llm = sleepy_llm
    pid = engine_core_pid(llm)
    updater = VLLMUpdater(engine=llm, changed_only=True, timeout_seconds=120)
    model = tiny_qwen2(seed=80 + level).cuda()
    updater.push_weights(model)
    llm.sleep(level=level)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    updater.push_weights(model)  # vLLM 57853: vLLM's own push into a sleeping engine ends its engine core
    state = updater.engine.sleep_state()
    assert state.weights_asleep == (level == 1) and state.kv_cache_asleep  # as the level allows
    llm.wake_up()
    serves(llm, model)
    llm.sleep(level=2)
    llm.wake_up()  # the user's own: vLLM maps fresh memory for the weights and keeps reporting the version
    with pytest.raises(WeightsDroppedError):
        VLLMWeightSync(updater=updater).rollouts.generate([[1, 2]])
    updater.push_weights(model.cuda())  # every layer: changed-only sends what was dropped
    serves(llm, model)
    assert engine_core_pid(llm) == pid


def test_vllm_serve_sleeps_through_its_routes_while_the_trainer_steps(gpu_model_dir, insecure_serialization, tmp_path):
    from gpu_helpers import gpu_server
    from helpers import engine_prompt_logprobs

    from lightning_vllm import HTTPEngine

    server = gpu_server(gpu_model_dir, tmp_path / "server.log", backend="ipc", extra_args=["--enable-sleep-mode"])
    try:
        engine = HTTPEngine(server.url)
        module, memory = Rollouts(seed=90), FreeAtBackward()
        sync = VLLMWeightSync(engine=engine, sleep_level=1, every_n_train_steps=1, timeout_seconds=120)
        gpu_trainer(tmp_path, [sync, memory], max_steps=3).fit(module, token_batches(3))
        version = sync.weight_version
        assert module.seen == [(version - 3 + step, version - 3 + step) for step in range(3)]
        freed = [asleep - awake for asleep, awake in zip(memory.free, module.free_awake)]
        FIGURES["sleep_server_level1_freed_mib"] = [value >> 20 for value in freed]
        assert min(freed) > 1 << 30, freed
        gap = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(module.hf))
        assert gap <= BOUND, gap
    finally:
        server.stop()
