"""Where vLLM lives: the in-process vllm.LLM adapter, with and without a separate engine process."""

from __future__ import annotations

import pytest
from helpers import assert_serves, build_llm, shutdown, tiny_qwen2

from lightning_vllm import EngineTarget, LocalLLMEngine, VLLMUpdater
from lightning_vllm.engines import as_engine_target


@pytest.mark.engine
def test_local_llm_adapter_reports_what_the_updater_checks(llm):
    engine = as_engine_target(llm)
    assert isinstance(engine, LocalLLMEngine) and isinstance(engine, EngineTarget)
    assert engine.transfer_backend() == "gloo"
    assert engine.device_type() == "cpu"
    assert (engine.tensor_parallel_size(), engine.num_workers()) == (1, 1)


def test_unsupported_engines_are_named():
    with pytest.raises(TypeError, match="Unsupported engine int.*server URL.*Ray actor handle"):
        as_engine_target(42)
    with pytest.raises(ValueError, match="Invalid engine URL 'localhost:8000'"):
        as_engine_target("localhost:8000")


@pytest.fixture(scope="module")
def llm_single_process(model_dir):
    """Engine core and worker inside the test process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = build_llm(model_dir, backend="gloo")
    yield engine
    shutdown(engine)


@pytest.mark.engine
def test_engine_in_the_training_process_receives_pushes(llm_single_process):
    from vllm.v1.engine.core_client import InprocClient

    assert isinstance(llm_single_process.llm_engine.engine_core, InprocClient)
    model = tiny_qwen2(seed=31)
    updater = VLLMUpdater(engine=llm_single_process, timeout_seconds=60)
    updater.push_weights(model)
    updater.push_weights(model)
    assert_serves(llm_single_process, model)
    assert llm_single_process.get_weight_version() == "2"
    updater.close()
