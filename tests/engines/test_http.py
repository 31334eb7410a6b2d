"""``vllm serve`` as a real subprocess: the callback pushes over vLLM's RL HTTP routes."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from helpers import free_port, start_server, tiny_qwen2
from vllm import SamplingParams

from lightning_vllm import EngineConfigError, HTTPEngine, VLLMUpdater, WeightSyncError


@pytest.mark.engine
def test_the_server_adapter_reports_what_the_updater_checks(server):
    engine = HTTPEngine(server.url)
    assert (engine.transfer_backend(), engine.device_type(), engine.num_workers()) == ("gloo", "cpu", 1)


@pytest.mark.engine
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
            VLLMUpdater(engine=f"http://127.0.0.1:{httpd.server_address[1]}", timeout_seconds=5).push_weights(
                tiny_qwen2()
            )
    finally:
        httpd.shutdown()


@pytest.mark.engine
def test_backend_mismatch_with_a_server(server):
    with pytest.raises(EngineConfigError, match="expects weight-transfer backend 'gloo' but this updater uses 'nccl'"):
        VLLMUpdater(engine=server.url, backend="nccl").push_weights(tiny_qwen2())


@pytest.mark.engine
@pytest.mark.parametrize(
    ("server_settings", "message"),
    [({"dev_mode": False}, "not a vLLM server in dev mode"), ({"backend": None}, "without a weight-transfer config")],
)
def test_servers_without_dev_mode_or_weight_transfer_config(
    served_model_dir, tmp_path_factory, server_settings, message
):
    misconfigured = start_server(served_model_dir, tmp_path_factory, **server_settings)
    try:
        with pytest.raises(EngineConfigError, match=message):
            VLLMUpdater(engine=misconfigured.url, timeout_seconds=10).push_weights(tiny_qwen2())
    finally:
        misconfigured.stop()
