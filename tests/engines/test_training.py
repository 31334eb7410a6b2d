"""A real Trainer pushes into each kind of engine, and vLLM serves the trained weights after.

The in-process ``vllm.LLM`` has its own, longer run of full pushes in ``tests/fronts/lightning/test_callback.py``;
it joins the LoRA adapter runs here.
"""

from __future__ import annotations

import pytest
from helpers import (
    PROMPTS,
    TOLERANCE,
    TinyCausalLM,
    assert_serves,
    cpu_trainer,
    hf_prompt_logprobs,
    lora_policy,
    max_abs_diff,
    served_logprobs,
    served_version,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
)

from lightning_vllm import HTTPEngine, RayEngine, VLLMWeightSync
from lightning_vllm.lora.adapter import AdapterWeights
from lightning_vllm.weights import source_metadata
from lightning_vllm.weights.sources import LoraBaseWeights

pytestmark = pytest.mark.engine

# What the user passes as engine=..., and the adapter the test reads the engine through.
ENGINES = {
    "AsyncLLM": lambda request: (request.getfixturevalue("async_engine"),) * 2,
    "vllm serve": lambda request: (
        request.getfixturevalue("server").url,
        HTTPEngine(request.getfixturevalue("server").url),
    ),
    "Ray actor": lambda request: (request.getfixturevalue("actor"), RayEngine(request.getfixturevalue("actor"))),
}


@pytest.mark.parametrize("kind", ENGINES)
def test_training_pushes_into_the_engine(kind, request, tmp_path):
    given, engine = ENGINES[kind](request)
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=given, every_n_train_steps=2)
    before, served_before = served_logprobs(engine), served_version(engine)

    cpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))

    module.hf.eval()
    # The test can fail: training moved the weights away from what the engine served before.
    assert max_abs_diff(before, hf_prompt_logprobs(module.hf)) > 1e-2
    assert_serves(engine, module.hf)
    # Fit start and step 2: two versions after what the engine served before.
    assert engine.get_weight_version() == str(sync.weight_version) == str(served_before + 2)


@pytest.mark.parametrize("kind", ENGINES)
def test_background_pushes_into_engines_that_serve_while_training(kind, request, tmp_path):
    given, engine = ENGINES[kind](request)
    module = TinyCausalLM(tiny_qwen2(seed=1), lr=1e-2)
    sync = VLLMWeightSync(engine=given, every_n_train_steps=1, blocking=False, when_busy="wait")
    served_before = served_version(engine)

    trainer = cpu_trainer(tmp_path, [sync], max_steps=2)
    trainer.fit(module, token_batches(num_batches=2))

    # Fit start, then steps 1 and 2 from the background thread; the last one landed before fit ended.
    assert engine.get_weight_version() == str(sync.weight_version) == str(served_before + 3)
    assert_serves(engine, module.hf)
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_stall_seconds")) == 3


ALL_ENGINES = {**ENGINES, "vllm.LLM": lambda request: (request.getfixturevalue("llm"),) * 2}


def num_bytes(source) -> int:
    return sum(dtype.itemsize * shape.numel() for dtype, shape in source_metadata(source).values())


@pytest.mark.parametrize("kind", ALL_ENGINES)
def test_training_a_lora_policy_pushes_only_its_adapter_and_rollouts_sample_from_it(kind, request, tmp_path):
    from vllm import SamplingParams

    given, _ = ALL_ENGINES[kind](request)
    policy = lora_policy()
    module = TinyCausalLM(policy, lr=1e-2)
    sync = VLLMWeightSync(engine=given, every_n_train_steps=1, lora="adapter")
    served_before = served_version(sync.updater.engine)

    cpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))

    policy.eval()
    adapter_bytes, base_bytes = num_bytes(AdapterWeights(policy)), num_bytes(LoraBaseWeights(policy))
    pushed = [value for _, value in tensorboard_scalars(tmp_path, "vllm/sync_bytes")]
    # Fit start sends the base weights once with the adapter; each step after, the adapter alone.
    assert pushed == [base_bytes + adapter_bytes] + [adapter_bytes] * 2
    assert adapter_bytes * 10 < base_bytes
    engine = sync.updater.engine
    assert engine.get_weight_version() == str(sync.weight_version) == str(served_before + 3)
    # Rollouts through the callback sample from the trained adapter: the PEFT model's logprobs.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    served = [rollout.prompt_logprobs for rollout in sync.generate(PROMPTS, params)]
    gap = max_abs_diff(served, hf_prompt_logprobs(policy))
    assert gap < TOLERANCE, f"served logprobs differ from the PEFT model's by {gap:.2e}"
    # ... and not from the base model alone (the test can fail).
    with policy.disable_adapter():
        assert max_abs_diff(served, hf_prompt_logprobs(policy)) > 1e-2


def test_an_adapter_the_engine_cannot_serve_is_refused_before_any_byte_moves_and_auto_sends_it_merged(llm):
    from peft import LoraConfig, get_peft_model

    from lightning_vllm import VLLMUpdater
    from lightning_vllm.errors import EngineConfigError

    policy = get_peft_model(tiny_qwen2(seed=3), LoraConfig(r=16, target_modules=["q_proj"], init_lora_weights=False))
    version, before = served_version(llm), served_logprobs(llm)
    with pytest.raises(EngineConfigError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        VLLMUpdater(engine=llm, lora="adapter").push_weights(policy)
    assert served_version(llm) == version and max_abs_diff(served_logprobs(llm), before) == 0.0

    updater = VLLMUpdater(engine=llm)  # lora="auto": merged weights, since the adapter cannot be served
    stats = updater.push_weights(policy)
    assert stats.num_bytes == num_bytes(LoraBaseWeights(policy)) and updater.lora_request is None
    assert_serves(llm, policy.merge_and_unload())
