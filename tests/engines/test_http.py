"""``vllm serve`` as a real subprocess: the callback pushes over vLLM's RL HTTP routes."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from helpers import (
    engine_prompt_logprobs,
    TinyCausalLM,
    VLLMServer,
    cpu_trainer,
    free_port,
    hf_prompt_logprobs,
    max_abs_diff,
    save_model,
    save_tokenizer,
    tiny_qwen2,
    token_batches,
)
from vllm import SamplingParams

from lightning_vllm import EngineConfigError, HTTPEngine, VLLMUpdater, VLLMWeightSync, WeightSyncError


@pytest.fixture(scope="module")
def served_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    save_model(tiny_qwen2(seed=0), directory)
    return save_tokenizer(directory)


def start(served_model_dir, tmp_path_factory, **kwargs):
    server = VLLMServer(served_model_dir, tmp_path_factory.mktemp("server") / "server.log", **kwargs)
    try:
        server.wait_until_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(served_model_dir, tmp_path_factory):
    server = start(served_model_dir, tmp_path_factory)
    yield server
    server.stop()  # also runs when a test failed


def test_training_pushes_into_a_vllm_server(server, tmp_path):
    engine = HTTPEngine(server.url)
    assert (engine.transfer_backend(), engine.device_type(), engine.num_workers()) == ("gloo", "cpu", 1)
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    before = engine_prompt_logprobs(engine)
    sync = VLLMWeightSync(engine=server.url, every_n_train_steps=2)
    cpu_trainer(tmp_path, [sync], max_steps=4).fit(module, token_batches(num_batches=4))
    module.hf.eval()
    trained = hf_prompt_logprobs(module.hf)
    assert max_abs_diff(before, trained) > 1e-2
    assert max_abs_diff(engine_prompt_logprobs(engine), trained) < 1e-4
    assert sync.weight_version == 3 and engine.get_weight_version() == "3"


def test_generations_carry_tokens_logprobs_text_and_version(server):
    engine = HTTPEngine(server.url)
    updater = VLLMUpdater(engine=server.url)
    updater.push_weights(tiny_qwen2(seed=5))
    (generation,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0))
    assert len(generation.token_ids) == 4 and len(generation.logprobs) == 4
    assert generation.text and generation.weight_version == "1"
    updater.close()


def test_unreachable_server_fails_fast_with_the_server_command():
    start_time = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"Cannot reach the vLLM server.*VLLM_SERVER_DEV_MODE=1 vllm serve"):
        VLLMUpdater(engine=f"http://127.0.0.1:{free_port()}", timeout_seconds=5).push_weights(tiny_qwen2())
    assert time.monotonic() - start_time < 10


def test_a_url_that_is_no_vllm_server_is_named():
    handler = http.server.SimpleHTTPRequestHandler
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineConfigError, match="not a vLLM server in dev mode.*VLLM_SERVER_DEV_MODE=1"):
            VLLMUpdater(engine=f"http://127.0.0.1:{httpd.server_address[1]}", timeout_seconds=5).push_weights(tiny_qwen2())
    finally:
        httpd.shutdown()


def test_backend_mismatch_with_a_server(server):
    with pytest.raises(EngineConfigError, match="expects weight-transfer backend 'gloo' but this updater uses 'nccl'"):
        VLLMUpdater(engine=server.url, backend="nccl").push_weights(tiny_qwen2())


def test_servers_without_dev_mode_or_weight_transfer_config(served_model_dir, tmp_path_factory):
    no_dev = start(served_model_dir, tmp_path_factory, dev_mode=False)
    try:
        with pytest.raises(EngineConfigError, match="not a vLLM server in dev mode"):
            VLLMUpdater(engine=no_dev.url, timeout_seconds=10).push_weights(tiny_qwen2())
    finally:
        no_dev.stop()
    no_config = start(served_model_dir, tmp_path_factory, backend=None)
    try:
        with pytest.raises(EngineConfigError, match="without a weight-transfer config"):
            VLLMUpdater(engine=no_config.url, timeout_seconds=10).push_weights(tiny_qwen2())
    finally:
        no_config.stop()
