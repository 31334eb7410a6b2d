"""A real Trainer pushes into each kind of engine, and vLLM serves the trained weights after.

The in-process ``vllm.LLM`` has its own, longer run in ``tests/test_callback.py``.
"""

from __future__ import annotations

import pytest
from helpers import (
    TinyCausalLM,
    assert_serves,
    cpu_trainer,
    hf_prompt_logprobs,
    max_abs_diff,
    served_logprobs,
    served_version,
    tiny_qwen2,
    token_batches,
)

from lightning_vllm import HTTPEngine, RayEngine, VLLMWeightSync

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
