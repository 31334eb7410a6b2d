"""``vllm serve`` as a real subprocess: the callback pushes over vLLM's RL HTTP routes."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import TinyCausalLM, cpu_trainer, free_port, tiny_qwen2, token_batches
from vllm import SamplingParams

from lightning_vllm import (
    EngineConfigError,
    HTTPEngine,
    VLLMUpdater,
    VLLMWeightSync,
    WeightSyncError,
    WeightSyncTimeoutError,
)


@pytest.mark.engine
def test_the_server_adapter_reports_what_the_updater_checks(server):
    engine = HTTPEngine(server.url)
    assert (engine.transfer_backend(), engine.device_type(), engine.num_workers()) == ("gloo", "cpu", 1)


@pytest.mark.engine
def test_generations_carry_tokens_logprobs_text_and_version(server):
    engine = HTTPEngine(server.url)
    updater = VLLMUpdater(engine=server.url)
    stats = updater.push_weights(tiny_qwen2(seed=5))
    (generation,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0))
    assert len(generation.token_ids) == 4 and len(generation.logprobs) == 4
    assert generation.text and generation.weight_version == stats.weight_version and generation.weight_version_exact
    updater.close()


def requests_running(url: str) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge, read from the server's open ``/metrics`` probe."""
    import requests

    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.engine
def test_a_completion_overtaken_by_a_push_reports_the_version_it_started_on(server):
    """A server cannot say which version produced a completion's first token: when a push lands while it
    runs, the completion carries the version served when it was sent (never newer), marked inexact."""
    from lightning_vllm._waits import BackgroundCall, wait_polling

    engine = HTTPEngine(server.url)
    updater = VLLMUpdater(engine=server.url)
    started_on = updater.push_weights(tiny_qwen2(seed=5)).weight_version
    long = SamplingParams(n=16, max_tokens=100, temperature=1.0, ignore_eos=True)
    call = BackgroundCall(engine.generate, [[1, 2, 3]], long, what="a long completion")
    wait_polling(
        lambda: requests_running(server.url) >= 1 or call.done(),
        timeout=30,
        interval=0.05,
        timeout_error=lambda: AssertionError("the server never ran the completion"),
    )
    assert not call.done(), "the completion ended before the push could overtake it"
    updater.push_weights(tiny_qwen2(seed=6))
    generations = call.result(60)
    assert {g.weight_version for g in generations} == {started_on}
    assert not any(g.weight_version_exact for g in generations)
    updater.close()


def test_unreachable_server_fails_fast_with_the_server_command():
    start_time = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"Cannot reach the vLLM server.*VLLM_SERVER_DEV_MODE=1 vllm serve"):
        VLLMUpdater(engine=f"http://127.0.0.1:{free_port()}", timeout_seconds=5).push_weights(tiny_qwen2())
    assert time.monotonic() - start_time < 10


def test_a_url_that_is_no_vllm_server_is_named():
    with serving(http.server.SimpleHTTPRequestHandler) as url:
        with pytest.raises(EngineConfigError, match="not a vLLM server in dev mode.*VLLM_SERVER_DEV_MODE=1"):
            VLLMUpdater(engine=url, timeout_seconds=5).push_weights(tiny_qwen2())


@pytest.mark.engine
def test_backend_mismatch_with_a_server(server):
    with pytest.raises(EngineConfigError, match="expects weight-transfer backend 'gloo' but this updater uses 'nccl'"):
        VLLMUpdater(engine=server.url, backend="nccl").push_weights(tiny_qwen2())


def test_a_server_without_weight_transfer_config_is_named():
    # What vLLM's /server_info reports for a dev-mode server started without
    # --weight-transfer-config (an in-process engine built that way is tested in test_updater.py).
    body = b'{"vllm_config": {"weight_transfer_config": null, "device_config": {"device_type": "cpu"}}}'
    with scripted_server(200, body) as (_, url):
        with pytest.raises(EngineConfigError, match="without a weight-transfer config"):
            VLLMUpdater(engine=url, timeout_seconds=10).push_weights(tiny_qwen2())


class ScriptedHandler(http.server.BaseHTTPRequestHandler):
    """Answers every request with the class's status and body (after ``delay`` seconds)."""

    status, body, delay = 200, b"{}", 0.0
    seen_headers: list = []
    seen_bodies: list = []

    def do_GET(self):
        self.answer()

    def do_POST(self):
        type(self).seen_bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self.answer()

    def answer(self):
        type(self).seen_headers.append(dict(self.headers))
        time.sleep(self.delay)
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` behind a local HTTP server for the ``with`` block; yields the server's URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@contextlib.contextmanager
def scripted_server(status: int, body: bytes, delay: float = 0.0) -> Iterator[tuple[type[ScriptedHandler], str]]:
    fields = {"status": status, "body": body, "delay": delay, "seen_headers": [], "seen_bodies": []}
    handler = type("Handler", (ScriptedHandler,), fields)
    with serving(handler) as url:
        yield handler, url


def test_a_server_started_without_the_variable_ipc_needs_is_named_with_the_restart_that_fixes_it():
    # What vLLM's /server_info reports (its "vllm_env") for a server started without the variable.
    body = b'{"vllm_config": {}, "vllm_env": {"VLLM_ALLOW_INSECURE_SERIALIZATION": false}}'
    with scripted_server(200, body) as (_, url):
        problem = HTTPEngine(url).ipc_handles_problem()
        assert problem is not None and "Restart it with VLLM_ALLOW_INSECURE_SERIALIZATION=1" in problem


def test_ipc_handles_go_to_a_server_pickled_as_vllms_own_http_client_sends_them():
    import base64
    import json
    import pickle

    import torch

    handles = {"GPU-0": (torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.bfloat16, 0, b"handle")}
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4]], "ipc_handles": handles}
    with scripted_server(200, b"{}") as (handler, url):
        HTTPEngine(url).update_weights(update)
        (sent,) = [json.loads(body)["update_info"] for body in handler.seen_bodies]
        assert "ipc_handles" not in sent and sent["names"] == ["w"]
        assert pickle.loads(base64.b64decode(sent["ipc_handles_pickled"])) == handles
        HTTPEngine(url).update_weights({"names": ["w"], "packed": True})  # nccl's update info goes as it is
        assert json.loads(handler.seen_bodies[-1])["update_info"] == {"names": ["w"], "packed": True}


def test_the_servers_own_error_message_is_in_the_error():
    body = b'{"error": {"message": "start_weight_update called while a weight update is already active"}}'
    with scripted_server(500, body) as (_, url):
        with pytest.raises(WeightSyncError, match="answered /start_weight_update with 500: start_weight_update called"):
            HTTPEngine(url).start_weight_update()


def test_a_server_that_needs_a_key_says_so_and_the_key_is_sent(monkeypatch):
    with scripted_server(401, b'{"error": {"message": "Unauthorized"}}') as (handler, url):
        monkeypatch.setenv("VLLM_API_KEY", "from-env")
        with pytest.raises(EngineConfigError, match="needs an API key.*api_key=.*VLLM_API_KEY"):
            HTTPEngine(url).pause_generation("keep")
        with pytest.raises(EngineConfigError):
            HTTPEngine(url, api_key="given").resume_generation()
        assert [headers.get("Authorization") for headers in handler.seen_headers] == [
            "Bearer from-env",
            "Bearer given",
        ]


def test_requests_follow_the_updaters_timeout():
    with scripted_server(200, b"{}", delay=3.0) as (_, url):
        engine = HTTPEngine(url)
        engine.follow_timeout(1.0)
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeoutError, match="did not answer /pause within 1 s"):
            engine.pause_generation("keep")
        assert time.monotonic() - start < 3.0
        own = HTTPEngine(url, timeout_seconds=5.0)
        own.follow_timeout(1.0)  # a timeout given to the adapter wins
        assert own.timeout_seconds == 5.0


def test_every_sampling_field_the_route_takes_is_sent_and_the_rest_refused():
    from lightning_vllm.engines.completions import completion_fields

    params = SamplingParams(
        max_tokens=5, temperature=0.7, top_k=4, min_p=0.1, stop=["x"], stop_token_ids=[3], ignore_eos=True,
        repetition_penalty=1.2, logprobs=1, prompt_logprobs=0, min_tokens=2, seed=3,
    )  # fmt: skip
    fields = completion_fields(params)
    assert fields["top_k"] == 4 and fields["min_p"] == 0.1 and fields["stop"] == ["x"]
    assert fields["stop_token_ids"] == [3] and fields["ignore_eos"] is True and fields["min_tokens"] == 2
    assert fields["repetition_penalty"] == 1.2 and fields["logprobs"] == 1 and fields["prompt_logprobs"] == 0
    assert "bad_words" not in fields  # left at its default: not sent
    with pytest.raises(ValueError, match=r"\['extra_args'\] cannot be sent"):
        completion_fields(SamplingParams(extra_args={"a": 1}))


@pytest.mark.engine
def test_the_guarded_servers_rl_routes_refuse_requests_without_the_key(server):
    import requests

    for path in ("init_weight_transfer_engine", "start_weight_update", "pause", "reset_prefix_cache"):
        assert requests.post(f"{server.url}/{path}", json={}, timeout=30).status_code == 401, path
    assert requests.get(f"{server.url}/server_info", timeout=30).status_code == 401
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    with pytest.raises(EngineConfigError, match="needs an API key"):
        VLLMUpdater(engine=HTTPEngine(server.url, api_key="not-the-key"), timeout_seconds=30).push_weights(tiny_qwen2())
    assert not requests.get(
        f"{server.url}/is_paused", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30
    ).json()["is_paused"]


def test_a_completion_is_bounded_by_the_timeout_its_caller_gives():
    """The callback's generate_timeout_seconds reaches the server's request, not the adapter's own 600 s."""
    with scripted_server(200, b"{}", delay=5.0) as (_, url):  # answers after 5 s
        engine = HTTPEngine(url)
        engine.served_model = "m"  # (what /v1/models would say)
        engine.get_weight_version = lambda: "1"  # (what /weight_info would say)
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeoutError, match="did not answer /v1/completions within 1 s"):
            engine.generate([[1, 2]], SamplingParams(max_tokens=1), timeout_seconds=1)
    assert time.monotonic() - start < 4 and engine.generate_timeout_seconds == 600


class ServerRolloutModule(TinyCausalLM):
    """Under DDP with the server's URL on every rank: each rank generates from it directly (nothing goes
    through rank 0), and every rank knows the version rank 0 pushed (staleness 0 on both)."""

    def training_step(self, batch, batch_idx):
        from vllm import SamplingParams

        from lightning_vllm import generate
        from lightning_vllm.fronts.lightning.rollouts import sampler_of

        sampler = sampler_of(self)
        assert sampler.ranks is None, "every rank holds an engine: nothing should go through rank 0"
        prompts = [[1 + self.global_rank, 2], [3, 4 + self.global_rank]]
        rollouts = generate(self, prompts, SamplingParams(max_tokens=2))
        assert [r.prompt_token_ids for r in rollouts] == prompts
        versions = {r.weight_version for r in rollouts}
        assert versions == {sampler.updater.weight_version}, (
            self.global_rank,
            versions,
            sampler.updater.weight_version,
        )
        return super().training_step(batch, batch_idx)


@pytest.mark.engine
def test_ddp_ranks_that_each_hold_the_server_generate_from_it_and_know_its_version(server, tmp_path):
    module = ServerRolloutModule(tiny_qwen2(seed=0), lr=1e-3)
    sync = VLLMWeightSync(engine=server.url, every_n_train_steps=1)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=2, strategy="ddp_spawn", devices=2, logger=False)
    trainer.fit(module, token_batches(num_batches=4))  # an assertion failing on a rank fails the fit


class SleepingServer(HTTPEngine):
    """The CPU server, said to be built with sleep mode (vLLM's CPU build refuses the flag; its workers' sleeps free
    nothing, but the routes, the engine core's pause and our plugin's notes are real: ``tests/sleeping_engine.py``)."""

    def _sleep_mode_enabled(self) -> bool:
        return True


@pytest.mark.engine
def test_a_server_sleeps_and_wakes_through_its_routes_and_a_push_wakes_its_weights_first(server):
    engine = SleepingServer(server.url)
    updater = VLLMUpdater(engine=engine, changed_only=True)
    model = tiny_qwen2(seed=7)
    full_bytes = updater.push_weights(model).num_bytes
    engine.sleep(2, "wait")
    assert engine.sleep_state().asleep == {"weights", "kv_cache"}
    assert updater.push_weights(model).num_bytes == full_bytes  # every layer after a drop, however unchanged
    assert engine.sleep_state().asleep == {"kv_cache"}
    engine.wake_up(["kv_cache"])
    assert not engine.sleep_state().asleep
    (generation,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert generation.weight_version == updater.weight_version
    updater.close()
