"""Engines of every kind, shared by the tests of this package (each takes ~20 s to start).

Package scope: they live while tests/engines runs, and are stopped before the
rest of the suite.
"""

from __future__ import annotations

import pytest
from helpers import (
    LORA_ENGINE,
    SERVER_API_KEY,
    build_llm,
    engine_kwargs,
    fake_hub_cache,
    save_model,
    save_tokenizer,
    shutdown,
    start_server,
    tiny_qwen2,
)

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
def hub_llm(tmp_path_factory):
    """A ``vllm.LLM`` started from a hub id, ``org/tiny-qwen2``, found in a Hugging Face cache made here (offline:
    nothing is fetched), as users name their models; its model ties the output embedding to the input embedding
    (vLLM's CPU build packs the head apart), and its workers have the tests' probe."""
    cache = fake_hub_cache(tmp_path_factory.mktemp("hub"), "org/tiny-qwen2", model=tiny_qwen2(tie_word_embeddings=True))
    with pytest.MonkeyPatch.context() as patch:
        import huggingface_hub.constants

        patch.setenv("HF_HUB_CACHE", str(cache))  # (vLLM's engine process reads it as it starts)
        patch.setenv("HF_HUB_OFFLINE", "1")
        # (this process read both at import: vLLM's front end and the check resolve the hub id here too)
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        engine = build_llm("org/tiny-qwen2", worker_extension_cls="worker_probe.WorkerProbe")
        yield engine
    shutdown(engine)


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
