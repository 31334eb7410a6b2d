"""Guarding a vLLM server's RL routes: an ASGI middleware for ``vllm serve --middleware``.

vLLM's ``--api-key`` guards only the OpenAI-style ``/v1`` routes. In dev mode (which
the weight-transfer routes need) anyone who reaches the port could otherwise call
``/init_weight_transfer_engine`` and point the workers at their own address, push
arbitrary weights, or ``/pause`` the server. :class:`RequireAPIKey` answers 401 to
every request without the key, except read-only health probes::

    VLLM_API_KEY=secret VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --weight-transfer-config '{"backend": "gloo"}' \\
        --middleware lightning_vllm.server.RequireAPIKey

The trainer sends the key with ``HTTPEngine(url, api_key=...)`` or the same
``VLLM_API_KEY`` variable in its environment. See ``docs/security.md``.

:class:`PauseLease` makes a server resume by itself when the trainer that paused it
dies before resuming it (add it with a second ``--middleware`` option), and
:class:`PushedAdapters` lets the server answer with the LoRA adapter a trainer pushed
(adapter pushes, ``docs/lora.md``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from lightning_vllm.engines.routes import ADAPTER_ROUTE, PAUSE_LEASE_HEADER
from lightning_vllm.lora.serving import PolicyAdapter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

# Probes that read nothing about the model or the engine's state and change nothing:
# load balancers and orchestrators call them without credentials.
OPEN_PROBES = frozenset({"/health", "/ping", "/version", "/metrics"})


class RequireAPIKey:
    """ASGI middleware: every HTTP request but a health probe needs ``Authorization: Bearer <key>``.

    The key is read from ``VLLM_API_KEY`` when the server starts (vLLM's own
    ``--api-key`` reads the same variable, so one key guards every route). It fails
    closed: a server started with this middleware but without the variable refuses to
    start.

    Args:
        app: the ASGI application to guard (vLLM passes it).
        api_key: the key; defaults to the ``VLLM_API_KEY`` environment variable.

    Example::

        >>> import asyncio
        >>> async def app(scope, receive, send):
        ...     await send({"type": "http.response.start", "status": 200, "headers": []})
        ...     await send({"type": "http.response.body", "body": b"ok"})
        >>> guarded, sent = RequireAPIKey(app, api_key="secret"), []
        >>> async def send(message):
        ...     sent.append(message)
        >>> scope = {"type": "http", "method": "POST", "path": "/pause", "headers": []}
        >>> asyncio.run(guarded(scope, None, send))
        >>> sent[0]["status"]
        401
    """

    def __init__(self, app: ASGIApp, api_key: str | None = None) -> None:
        key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError(
                "lightning_vllm.server.RequireAPIKey needs a key: set VLLM_API_KEY in the server's environment "
                "(the trainer sends the same key with HTTPEngine(url, api_key=...) or its own VLLM_API_KEY)."
            )
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        message = "This route needs the server's API key (Authorization: Bearer <key>)."
        await _answer(send, 401, {"error": {"message": message, "code": 401}}, [(b"www-authenticate", b"Bearer")])

    def _allowed(self, scope: Scope) -> bool:
        if scope.get("method") in ("GET", "HEAD") and scope.get("path") in OPEN_PROBES:
            return True
        offered = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(offered, self._expected)


class PauseLease:
    """ASGI middleware: a ``/pause`` that carries a lease ends by itself if no ``/resume`` comes.

    A trainer pauses generation for the few hundred milliseconds in which the engine
    loads and commits an update. Killed inside that window, it would leave the server
    paused for good. ``HTTPEngine`` sends each ``/pause`` with the header
    ``X-Lightning-VLLM-Pause-Lease: <seconds>`` (its timeout plus 5 s); this middleware
    resumes generation when the lease runs out, unless a ``/resume`` came first. A
    ``/pause`` without the header (an operator's) is left alone.

    Args:
        app: the ASGI application (vLLM passes it).

    Example (the server side)::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}' \\
            --middleware lightning_vllm.server.RequireAPIKey --middleware lightning_vllm.server.PauseLease
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._expiry: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ("/pause", "/resume"):
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        await self.app(scope, receive, send_and_note)
        if not status or status[0] >= 400:
            return
        self._cancel()  # a new pause, or a resume, replaces any lease running
        lease = dict(scope.get("headers") or []).get(PAUSE_LEASE_HEADER.encode())
        if scope["path"] == "/pause" and lease is not None:
            seconds = float(lease.decode())
            engine_client = scope["app"].state.engine_client
            self._expiry = asyncio.get_running_loop().call_later(
                seconds, lambda: asyncio.ensure_future(self._expire(engine_client, seconds))
            )

    def _cancel(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _expire(self, engine_client: Any, seconds: float) -> None:
        self._expiry = None
        log.warning(
            "Generation was paused by a trainer that did not resume it within its %g s lease (it stopped or "
            "died mid-push); resuming.",
            seconds,
        )
        await engine_client.resume_generation()


class PushedAdapters:
    """ASGI middleware: answer, under a model name, with the LoRA adapter a trainer pushed.

    An adapter push (``VLLMWeightSync(lora="adapter")``) sends the adapter over the
    weight transport; the server's workers stage it on their own host. vLLM's server
    maps a request's ``model`` to an adapter only through ``/v1/load_lora_adapter``,
    which needs a path and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; this middleware
    records the name, id and key the trainer pushed (``POST /lightning_vllm/adapter``),
    so ``/v1/completions`` with ``"model": "lightning-vllm-policy"`` samples from the
    pushed adapter. Nothing is loaded here and nothing is unpickled: the body is three
    JSON fields, and the path is made here from the key.

    Args:
        app: the ASGI application (vLLM passes it).

    Example (the server side)::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}' \\
            --enable-lora --max-lora-rank 16 --middleware lightning_vllm.server.PushedAdapters
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != ADAPTER_ROUTE:
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "GET":
            await _answer(send, 200, {"pushed_adapters": True})
            return
        try:
            body = json.loads(await _read_body(receive))
            adapter = PolicyAdapter(key=str(body["key"]), name=str(body["name"]), lora_id=int(body["id"]))
            request = adapter.lora_request()  # checks the key
        except (ValueError, KeyError, TypeError) as error:
            message = f"Expected JSON {{'name', 'id', 'key'}}: {error}"
            await _answer(send, 400, {"error": {"message": message, "code": 400}})
            return
        scope["app"].state.openai_serving_models.lora_requests[adapter.name] = request
        log.info("Answering as %r with the LoRA adapter a trainer pushed (%s).", adapter.name, request.lora_path)
        await _answer(send, 200, {"name": adapter.name, "id": adapter.lora_id})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(
    send: Send, status: int, payload: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", b"application/json"), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
