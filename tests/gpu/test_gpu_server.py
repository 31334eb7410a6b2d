"""``vllm serve`` on the GPU behind ``HTTPEngine``, over ipc: the handles go pickled, as vLLM's own HTTP
client sends them, to a server started with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``."""

from __future__ import annotations

import pytest
from gpu_helpers import gpu_trainer, hf_prompt_logprobs
from helpers import TinyCausalLM, engine_prompt_logprobs, max_abs_diff, tiny_qwen2, token_batches

from lightning_vllm import HTTPEngine, VLLMWeightSync

pytestmark = pytest.mark.gpu


def test_fit_pushes_into_vllm_serve_over_ipc(server_starting, tmp_path):
    server = server_starting
    server.wait_until_healthy(timeout=300)
    engine = HTTPEngine(server.url)
    assert engine.transfer_backend() == "ipc" and engine.ipc_handles_problem() is None  # its /server_info says so
    module = TinyCausalLM(tiny_qwen2(seed=30), lr=1e-2)
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1)

    gpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))

    measured = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(module.hf))
    assert measured <= 4e-4, measured
    assert engine.get_weight_version() == str(sync.weight_version) == "3"  # fit start, steps 1 and 2
