"""AsyncLLM in the training process: pushes pause generation, requests in flight are kept."""

from __future__ import annotations

import threading

import pytest
from helpers import (
    engine_prompt_logprobs,
    TinyCausalLM,
    cpu_trainer,
    engine_kwargs,
    hf_prompt_logprobs,
    max_abs_diff,
    tiny_qwen2,
    token_batches,
)
from vllm import SamplingParams

from lightning_vllm import AsyncLLMEngine, VLLMUpdater, VLLMWeightSync
from lightning_vllm.engines.base import spans


@pytest.fixture(scope="module")
def async_engine(model_dir):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(**engine_kwargs(model_dir, max_model_len=256))
    engine = AsyncLLMEngine(AsyncLLM.from_engine_args(args))
    yield engine
    engine.async_llm.shutdown()


def test_training_pushes_into_an_async_engine(async_engine, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=async_engine, every_n_train_steps=2)
    cpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))
    module.hf.eval()
    assert max_abs_diff(engine_prompt_logprobs(async_engine), hf_prompt_logprobs(module.hf)) < 1e-4
    assert async_engine.get_weight_version() == str(sync.weight_version) == "2"


def test_a_request_in_flight_survives_a_push_and_reports_both_versions(async_engine):
    from vllm import TokensPrompt

    updater = VLLMUpdater(engine=async_engine)  # pause_mode="keep" by default
    updater.push_weights(tiny_qwen2(seed=70))
    first_tokens = threading.Event()

    async def long_request():
        final = None
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        async for output in async_engine.async_llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]), params, request_id="long"):
            first_tokens.set()
            final = output
        return final

    in_flight = async_engine.submit(long_request())
    assert first_tokens.wait(60)
    updater.push_weights(tiny_qwen2(seed=71))
    final = in_flight.result(timeout=120)

    (sample,) = final.outputs
    assert len(sample.token_ids) == 240  # nothing lost
    versions = [version for version, _, _ in spans(sample.weight_versions)]
    assert versions[0] == "1" and versions[-1] == "2"
    updater.close()
