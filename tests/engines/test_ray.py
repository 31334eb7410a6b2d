"""A vLLM engine inside a Ray actor on a local Ray cluster started by the test."""

from __future__ import annotations

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

from lightning_vllm import RayEngine, VLLMActor, VLLMUpdater, VLLMWeightSync


@pytest.fixture(scope="module")
def actor(model_dir):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    handle = ray.remote(num_cpus=1)(VLLMActor).remote(**engine_kwargs(model_dir))
    yield handle
    ray.kill(handle)
    ray.shutdown()


def test_training_pushes_into_a_ray_actor(actor, tmp_path):
    engine = RayEngine(actor)
    assert (engine.transfer_backend(), engine.num_workers()) == ("gloo", 1)
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=actor, every_n_train_steps=2)
    cpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))
    module.hf.eval()
    assert max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(module.hf)) < 1e-4
    assert engine.get_weight_version() == str(sync.weight_version) == "2"


def test_a_ray_actor_beside_an_in_process_engine(actor, llm):
    model = tiny_qwen2(seed=80)
    updater = VLLMUpdater(engine=[llm, actor])
    updater.push_weights(model, worker_ids=[1])
    assert max_abs_diff(engine_prompt_logprobs(RayEngine(actor)), hf_prompt_logprobs(model)) < 1e-4
    assert updater.engine_versions()[1] == "1"
    updater.close()
