"""The ASGI middleware that guards a vLLM server's RL routes (no server needed: a plain ASGI app)."""

from __future__ import annotations

import asyncio
import doctest

import pytest

import lightning_vllm.server
from lightning_vllm.server import RequireAPIKey


async def inner_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def status_of(app, method: str, path: str, authorization: str | None = None) -> int:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": headers}, None, send))
    return sent[0]["status"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/init_weight_transfer_engine"),
        ("POST", "/update_weights"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/collective_rpc"),
        ("GET", "/server_info"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/health"),  # only reading a probe is open
    ],
)
def test_routes_that_change_or_reveal_the_engine_need_the_key(method, path):
    guarded = RequireAPIKey(inner_app, api_key="secret")
    assert status_of(guarded, method, path) == 401
    assert status_of(guarded, method, path, "Bearer wrong") == 401
    assert status_of(guarded, method, path, "secret") == 401  # the scheme is part of it
    assert status_of(guarded, method, path, "Bearer secret") == 200


@pytest.mark.parametrize("path", ["/health", "/ping", "/version", "/metrics"])
def test_health_probes_stay_open(path):
    assert status_of(RequireAPIKey(inner_app, api_key="secret"), "GET", path) == 200


def test_the_key_comes_from_the_environment_and_is_required(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert status_of(RequireAPIKey(inner_app), "POST", "/pause", "Bearer from-env") == 200
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="set VLLM_API_KEY in the server's environment"):
        RequireAPIKey(inner_app)


def test_the_docstring_example_runs():
    assert doctest.testmod(lightning_vllm.server).failed == 0


class FakeEngineClient:
    """Stands in for vLLM's engine client behind the routes: counts resumes."""

    def __init__(self) -> None:
        self.resumes = 0

    async def resume_generation(self) -> None:
        self.resumes += 1


def lease_scenario(requests: list[tuple[str, float | None, int]], wait: float) -> int:
    """Send ``(path, lease seconds or None, status the route answers)`` in order through
    ``PauseLease``, wait ``wait`` seconds, and return how many times it resumed by itself."""
    from types import SimpleNamespace

    from lightning_vllm.server import PAUSE_LEASE_HEADER, PauseLease

    client = FakeEngineClient()
    app_state = SimpleNamespace(state=SimpleNamespace(engine_client=client))

    async def run() -> None:
        for path, lease, status in requests:

            async def route(scope, receive, send, status=status):
                await send({"type": "http.response.start", "status": status, "headers": []})
                await send({"type": "http.response.body", "body": b"{}"})

            async def send(message):
                pass

            headers = [(PAUSE_LEASE_HEADER.encode(), str(lease).encode())] if lease is not None else []
            scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "app": app_state}
            middleware.app = route  # (one middleware for all of them: it holds the lease)
            await middleware(scope, None, send)
        await asyncio.sleep(wait)

    middleware = PauseLease(None)
    asyncio.run(run())
    return client.resumes


def test_a_pause_whose_lease_runs_out_is_resumed_by_the_server():
    assert lease_scenario([("/pause", 0.1, 200)], wait=0.5) == 1


def test_a_resume_in_time_ends_the_lease():
    assert lease_scenario([("/pause", 0.3, 200), ("/resume", None, 200)], wait=0.6) == 0


def test_pauses_without_a_lease_or_that_failed_are_left_alone():
    assert lease_scenario([("/pause", None, 200)], wait=0.3) == 0
    assert lease_scenario([("/pause", 0.1, 500)], wait=0.3) == 0


def test_a_new_pause_replaces_the_lease_running():
    assert lease_scenario([("/pause", 0.2, 200), ("/pause", 10.0, 200)], wait=0.5) == 0


def pushed_adapters_call(method: str, body: bytes = b"", path: str = "/lightning_vllm/adapter"):
    """One request through ``PushedAdapters`` in front of an app whose state has vLLM's serving models."""
    from types import SimpleNamespace

    from lightning_vllm.server import PushedAdapters

    models = SimpleNamespace(lora_requests={})
    app = SimpleNamespace(state=SimpleNamespace(openai_serving_models=models))
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "app": app}
    asyncio.run(PushedAdapters(inner_app)(scope, receive, send))
    return sent[0]["status"], sent[1]["body"], models.lora_requests


def test_pushed_adapters_answers_under_the_name_the_trainer_gives():
    from lightning_vllm.in_vllm.lora_adapters import adapter_directory

    assert pushed_adapters_call("GET")[:2] == (200, b'{"pushed_adapters": true}')
    status, _, served = pushed_adapters_call("POST", b'{"name": "policy", "id": 7, "key": "abc123"}')
    assert status == 200
    request = served["policy"]
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("policy", 7, adapter_directory("abc123"))


@pytest.mark.parametrize(
    "body", [b"not json", b'{"name": "policy"}', b'{"name": "p", "id": 1, "key": "../../etc"}'], ids=str
)
def test_pushed_adapters_refuses_a_bad_body_and_a_path_outside_its_directory(body):
    status, answer, served = pushed_adapters_call("POST", body)
    assert status == 400 and b"Expected JSON" in answer and served == {}


def test_pushed_adapters_leaves_other_routes_alone():
    assert pushed_adapters_call("POST", path="/v1/completions")[:2] == (200, b"served")
