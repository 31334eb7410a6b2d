"""AsyncLLM in the training process: pushes pause generation, requests in flight are kept."""

from __future__ import annotations

import threading

import pytest
from helpers import tiny_qwen2
from vllm import SamplingParams

from lightning_vllm import VLLMUpdater
from lightning_vllm.engines.base import spans

pytestmark = pytest.mark.engine


def test_a_request_in_flight_survives_a_push_and_reports_both_versions(async_engine):
    from vllm import TokensPrompt

    updater = VLLMUpdater(engine=async_engine)  # pause_mode="keep" by default
    version = updater.push_weights(tiny_qwen2(seed=70)).weight_version
    first_tokens = threading.Event()

    async def long_request():
        final = None
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=[1, 2, 3])
        async for output in async_engine.async_llm.generate(prompt, params, request_id="long"):
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
    assert versions[0] == version and versions[-1] == version + 1
    updater.close()
