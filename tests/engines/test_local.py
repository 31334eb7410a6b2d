"""Where vLLM lives: the in-process vllm.LLM adapter, with and without a separate engine process."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from helpers import TinyCausalLM, assert_serves, build_llm_in_process, cpu_trainer, shutdown, tiny_qwen2, token_batches

from lightning_vllm import EngineConfigError, EngineTarget, LocalLLMEngine, VLLMUpdater, VLLMWeightSync
from lightning_vllm.engines import as_engine_target
from lightning_vllm.engines.local import _guard_request_socket


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
    engine = build_llm_in_process(model_dir, backend="gloo")
    yield engine
    shutdown(engine)


def test_the_request_socket_of_a_multiprocess_client_takes_one_sender_at_a_time():
    inside = []

    def send(request: int) -> None:
        inside.append(request)
        assert len(inside) == 1, "two threads inside the socket's send at once"
        time.sleep(0.01)
        inside.remove(request)

    client = SimpleNamespace(_send_input=send)
    assert _guard_request_socket(client)
    guarded = client._send_input
    assert _guard_request_socket(client) and client._send_input is guarded  # one lock per client
    threads = [threading.Thread(target=client._send_input, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not inside
    assert not _guard_request_socket(SimpleNamespace())  # an in-process client: one thread only


@pytest.mark.engine
def test_engine_in_the_training_process_receives_pushes(llm_single_process, tmp_path):
    from vllm.v1.engine.core_client import InprocClient

    assert isinstance(llm_single_process.llm_engine.engine_core, InprocClient)
    model = tiny_qwen2(seed=31)
    updater = VLLMUpdater(engine=llm_single_process, timeout_seconds=60, verify_pushes=True)
    updater.push_weights(model)
    updater.push_weights(model)
    # Its worker runs in this process: it is asked for its sums with a function, with no extension.
    assert updater.last_sync is not None and updater.last_sync.timing.check_seconds > 0
    assert_serves(llm_single_process, model)
    assert llm_single_process.get_weight_version() == "2"
    updater.close()
    # Only one thread may drive this engine: background pushes are refused before any byte moves.
    sync = VLLMWeightSync(engine=llm_single_process, blocking=False)
    with pytest.raises(EngineConfigError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0.*blocking=True"):
        cpu_trainer(tmp_path, [sync], max_steps=1).fit(TinyCausalLM(model), token_batches(num_batches=1))
    assert llm_single_process.get_weight_version() == "2"
