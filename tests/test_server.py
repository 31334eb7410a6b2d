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
