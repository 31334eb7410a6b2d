"""Engines of every kind, shared by the tests of this package (each takes ~20 s to start).

Package scope: they live while tests/engines runs, and are stopped before the
rest of the suite.
"""

from __future__ import annotations

import pytest
from helpers import LORA_ENGINE, SERVER_API_KEY, engine_kwargs, save_model, save_tokenizer, start_server, tiny_qwen2

from lightning_vllm import AsyncLLMEngine


@pytest.fixture(scope="package")
def async_engine(model_dir):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(**engine_kwargs(model_dir, max_model_len=256, **LORA_ENGINE))
    engine = AsyncLLMEngine(AsyncLLM.from_engine_args(args))
    yield engine
    engine.async_llm.shutdown(timeout=1.0)  # see helpers.shutdown


@pytest.fixture(scope="package")
def served_model_dir(tmp_path_factory):
    """The tiny model with a tokenizer beside it: vLLM's server needs one for /v1/completions."""
    directory = tmp_path_factory.mktemp("served")
    save_model(tiny_qwen2(seed=0), directory)
    return save_tokenizer(directory)


@pytest.fixture(scope="package")
def server(served_model_dir, tmp_path_factory):
    """``vllm serve`` in dev mode with the gloo backend, as a real subprocess, its routes guarded
    by ``RequireAPIKey``: the tests' trainers send the key from ``VLLM_API_KEY``, as users do.
    It serves pushed LoRA adapters (``--enable-lora``, ``PushedAdapters``)."""
    server = start_server(served_model_dir, tmp_path_factory, api_key=SERVER_API_KEY, lora=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_API_KEY", SERVER_API_KEY)
        yield server
    server.stop()  # also runs when a test failed


@pytest.fixture(scope="package")
def actor(model_dir):
    """A VLLMActor on a local Ray cluster started here."""
    import ray

    from lightning_vllm import VLLMActor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    handle = ray.remote(num_cpus=1)(VLLMActor).remote(**engine_kwargs(model_dir, **LORA_ENGINE))
    yield handle
    ray.kill(handle)
    ray.shutdown()
