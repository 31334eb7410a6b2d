"""``AsyncLLM`` on the GPU over ipc, in each pause mode, with a request in flight during the push."""

from __future__ import annotations

import time

import pytest
from gpu_helpers import FIGURES, hf_prompt_logprobs
from helpers import PROMPTS, engine_prompt_logprobs, max_abs_diff, tiny_qwen2

from lightning_vllm import VLLMUpdater

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_a_push_in_each_pause_mode_lands_beside_a_request_in_flight(async_ipc_engine, mode):
    from vllm import SamplingParams

    engine = async_ipc_engine
    model = tiny_qwen2(seed={"keep": 11, "wait": 12, "abort": 13}[mode]).cuda()
    updater = VLLMUpdater(engine=engine, pause_mode=mode, timeout_seconds=60)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    in_flight = engine.submit(engine.generate_async([PROMPTS[0]], long))
    time.sleep(0.2)  # the request is being served when the push pauses generation

    stats = updater.push_weights(model)

    try:
        (generation,) = in_flight.result(timeout=120)
        outcome = f"{len(generation.token_ids)} tokens, versions {generation.weight_versions}"
        if mode != "abort":  # kept, or waited for: it runs to its end
            assert len(generation.token_ids) == 200
    except Exception as error:  # noqa: BLE001  # an aborted request may end in an error of its own
        assert mode == "abort", error
        outcome = f"{type(error).__name__}: {error}"
    FIGURES[f"async_{mode}_push_seconds"] = stats.seconds
    print(f"pause_mode={mode}: the request in flight ended with {outcome}")
    measured = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(model))
    assert measured <= 4e-4, measured
    assert engine.get_weight_version() == str(stats.weight_version)
    updater.close()
