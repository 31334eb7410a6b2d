"""A vLLM server (``vllm serve``) reached over HTTP.

The server must run in dev mode with a weight-transfer config, which exposes
vLLM's RL routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/pause``, ``/resume``,
``/reset_prefix_cache``, ``/server_info``, ...)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --host 127.0.0.1 --port 8000 \\
        --weight-transfer-config '{"backend": "gloo"}'

The ``gloo`` backend is loaded in the server by lightning-vllm's vLLM plugin entry
point: install lightning-vllm in the server's environment, nothing else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from functools import cached_property
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.engines.base import (
    ChecksIPCHandles,
    FollowsUpdaterTimeout,
    Generation,
    NamesItsEngine,
    PauseMode,
    PolicyAdapter,
    ReportsLayerSums,
    ServesAdapter,
    parse_weight_version,
)
from lightning_vllm.engines.completions import completion_fields
from lightning_vllm.engines.routes import ADAPTER_ROUTE, PAUSE_LEASE_HEADER
from lightning_vllm.engines.serialization import server_ipc_handles_problem
from lightning_vllm.engines.sleep import SleepMode
from lightning_vllm.engines.worker_check import LAYER_SUMS_METHOD, layer_sums_problem
from lightning_vllm.errors import EngineBusyError, EngineConfigError, WeightSyncError, WeightSyncTimeoutError
from lightning_vllm.lora.serving import LoraLimits, lora_limits_from
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.settings import DEFAULT_GENERATE_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS, validate_timeout
from lightning_vllm.weights.checks import ExpectedWeights, engine_weights

PAUSE_LEASE_MARGIN_SECONDS = 5.0
SERVER_COMMAND = 'VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config \'{"backend": "gloo"}\''

log = logging.getLogger(__name__)


_NO_ADAPTER_MIDDLEWARE = (
    "the server cannot answer with a LoRA adapter a trainer pushed. Start it with "
    "--middleware lightning_vllm.server.PushedAdapters (and --enable-lora), or push merged weights (lora='merged')."
)


class HTTPEngine(ServesAdapter, FollowsUpdaterTimeout, ChecksIPCHandles, NamesItsEngine, ReportsLayerSums, SleepMode):
    """Engine target for a vLLM server.

    Args:
        base_url: the server's address, e.g. ``"http://127.0.0.1:8000"``.
        timeout_seconds: the longest one control request may take; ``None`` (the
            default) follows the updater's ``timeout_seconds``.
        api_key: sent as ``Authorization: Bearer`` on every request; defaults to the
            ``VLLM_API_KEY`` environment variable. Servers that guard their RL routes
            with :class:`lightning_vllm.server.RequireAPIKey` (or ``--api-key``) need it.
        generate_timeout_seconds: the longest one ``/v1/completions`` request may take when
            :meth:`generate` is not given its own ``timeout_seconds`` (rollouts through the callback
            always give the callback's ``generate_timeout_seconds``).

    Example::

        >>> engine = HTTPEngine("http://127.0.0.1:8000", api_key="secret")  # doctest: +SKIP
        >>> engine.transfer_backend()  # doctest: +SKIP
        'gloo'
    """

    def __init__(
        self,
        base_url: str,
        timeout_seconds: float | None = None,
        *,
        api_key: str | None = None,
        generate_timeout_seconds: float = DEFAULT_GENERATE_TIMEOUT_SECONDS,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"Invalid engine URL {base_url!r}: expected e.g. 'http://127.0.0.1:8000'.")
        self.base_url = base_url.rstrip("/")
        self.description = f"vLLM server at {self.base_url}"
        self.timeout_seconds = timeout_seconds
        if timeout_seconds is not None:
            validate_timeout(timeout_seconds)
        validate_timeout(generate_timeout_seconds)
        self.generate_timeout_seconds = generate_timeout_seconds
        self.api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY") or None

    def engine_key(self) -> Hashable:
        return "url", self.base_url

    def follow_timeout(self, timeout_seconds: float) -> None:
        """Use ``timeout_seconds`` for control requests unless the adapter was given its own."""
        if self.timeout_seconds is None:
            self.timeout_seconds = timeout_seconds

    def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
        missing: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """One request; every failure becomes this package's error, with the server's own message.

        ``missing`` is what a 404 means, when it is not a server outside dev mode.
        """
        import requests

        url = f"{self.base_url}/{path.lstrip('/')}"
        timeout = timeout or self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        headers = {**(headers or {}), **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        try:
            response = requests.request(method, url, timeout=timeout, headers=headers, **kwargs)
        except requests.ConnectionError as error:
            raise WeightSyncError(
                f"Cannot reach the vLLM server at {self.base_url} ({type(error).__name__}). Check the URL and that the "
                f"server is running, e.g. {SERVER_COMMAND}"
            ) from error
        except requests.Timeout as error:
            raise WeightSyncTimeoutError(
                f"The vLLM server at {self.base_url} did not answer /{path} within {timeout:g} s. Raise the "
                "updater's timeout_seconds if the server is busy (a large model), or check that it is alive."
            ) from error
        except requests.RequestException as error:
            raise WeightSyncError(f"The request to {url} failed: {error}") from error
        if response.status_code == 401:
            raise EngineConfigError(
                f"The vLLM server at {self.base_url} refused /{path}: it needs an API key "
                f"({_server_message(response)}). Pass api_key=... to HTTPEngine or set VLLM_API_KEY in the "
                "trainer's environment to the server's key."
            )
        if response.status_code == 404:
            raise EngineConfigError(
                f"{url} does not exist: "
                + (missing or f"the server is not a vLLM server in dev mode. Start it with {SERVER_COMMAND}")
            )
        if response.status_code == 503:  # vLLM 0.33 while generation is paused for a weight update
            raise EngineBusyError(
                f"The vLLM server at {self.base_url} refused /{path} for now: {_server_message(response)}"
            )
        if not response.ok:
            raise WeightSyncError(
                f"The vLLM server at {self.base_url} answered /{path} with {response.status_code}: "
                f"{_server_message(response)}"
            )
        try:
            return response.json() if response.content else None
        except ValueError as error:
            raise WeightSyncError(
                f"The vLLM server at {self.base_url} answered /{path} with something that is not JSON: "
                f"{response.text[:200]!r}"
            ) from error

    @cached_property
    def _server_info(self) -> dict[str, Any]:
        return dict(self._request("GET", "server_info", params={"config_format": "json"}))

    @cached_property
    def _config(self) -> dict[str, Any]:
        return dict(self._server_info["vllm_config"])

    def ipc_handles_problem(self) -> str | None:
        """Whether the server's workers will unpickle CUDA IPC handles (its ``/server_info`` says)."""
        environment = self._server_info.get("vllm_env")
        return server_ipc_handles_problem(environment if isinstance(environment, dict) else None, self.description)

    def _ask_workers(self, method: str) -> list[Any]:
        # vLLM's dev-mode /collective_rpc calls a worker method by name; nothing is pickled.
        return list(self._request("POST", "collective_rpc", json={"method": method})["results"])

    def layer_sums_problem(self) -> str | None:
        """Whether the server's workers answer the layer-sums methods our plugin gives them."""
        return layer_sums_problem(self._ask_workers, self.description)

    def layer_sums(self) -> list[dict[str, Any]]:
        return self._ask_workers(LAYER_SUMS_METHOD)

    def transfer_backend(self) -> str | None:
        config = self._config.get("weight_transfer_config")
        return None if not config else str(config["backend"])

    def device_type(self) -> str:
        device = self._config.get("device_config", {})
        return str(device.get("device_type") or device.get("device") or "cpu")

    def tensor_parallel_size(self) -> int:
        return int(self._config["parallel_config"]["tensor_parallel_size"])

    def num_workers(self) -> int:
        return int(self._request("GET", "get_world_size", params={"include_dp": True})["world_size"])

    @cached_property
    def _model_config(self) -> Any:
        """The served model's transformers config, readable when the server runs on this machine (or shares its file
        system or Hugging Face cache: nothing is downloaded); ``None`` otherwise."""
        from transformers import AutoConfig

        model_config = self._config["model_config"]
        try:
            return AutoConfig.from_pretrained(
                str(model_config["model"]), revision=model_config.get("revision"), local_files_only=True
            )
        except (OSError, ValueError):
            return None

    def expected_weights(self) -> ExpectedWeights | None:
        model_config, hf_config = self._config["model_config"], self._model_config
        if hf_config is None:
            return None
        dtype = getattr(torch, str(model_config["dtype"]).removeprefix("torch."))
        return engine_weights(
            str(model_config["model"]),
            serving_dtype=dtype,
            ties_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            hf_config=hf_config,
            revision=model_config.get("revision"),
        )

    def is_dead(self) -> bool:
        """A server that is gone refuses connections, which each request reports at once."""
        return False

    def lora_limits(self) -> LoraLimits | None:
        return lora_limits_from(self._config.get("lora_config"))

    def check_serves_adapters(self) -> None:
        """Raise :class:`EngineConfigError` unless the server can answer with an adapter a trainer pushed.

        That takes ``lightning_vllm.server.PushedAdapters``: vLLM's own route needs a path the server reads.
        """
        self._request("GET", ADAPTER_ROUTE, missing=_NO_ADAPTER_MIDDLEWARE)

    def serve_adapter(self, adapter: PolicyAdapter | None) -> None:
        """Have the server answer to the adapter's name (``PushedAdapters``), then generate through it."""
        if adapter is not None:
            body = {"name": adapter.name, "id": adapter.lora_id, "key": adapter.key}
            self._request("POST", ADAPTER_ROUTE, json=body, missing=_NO_ADAPTER_MIDDLEWARE)
        self.adapter = adapter

    def prompt_limits(self) -> PromptLimits:
        model_config, hf_config = self._config["model_config"], self._model_config
        vocab_size = getattr(hf_config, "vocab_size", None)
        return PromptLimits(
            vocab_size=int(vocab_size) if vocab_size is not None else None,
            max_model_len=int(model_config["max_model_len"]),
            accepts_text=not model_config.get("skip_tokenizer_init", False),
        )

    # vLLM's weight-sync routes, with the same bodies as vLLM's HTTPVLLMWeightSyncClient
    # (whose raw `requests` errors and fixed timeout this target replaces).
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "start_weight_update")

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        sent = [_json_safe(info) for info in update_info] if isinstance(update_info, list) else _json_safe(update_info)
        self._request("POST", "update_weights", json={"update_info": sent})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._request("POST", "finish_weight_update", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str | None:
        return self._request("GET", "weight_info")["weight_version"]

    def reset_prefix_cache(self) -> None:
        # As for AsyncLLM: requests kept across the update are recomputed with the new weights.
        answer = self._request("POST", "reset_prefix_cache", params={"reset_running_requests": "true"})
        if isinstance(answer, dict) and answer.get("success") is False:
            log.warning("The vLLM server at %s could not reset its prefix cache after a weight update.", self.base_url)

    def pause_generation(self, mode: PauseMode) -> None:
        # A server with lightning_vllm.server.PauseLease resumes by itself if this trainer
        # dies before its /resume; other servers ignore the header.
        lease = (self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS) + PAUSE_LEASE_MARGIN_SECONDS
        headers = {PAUSE_LEASE_HEADER: f"{lease:g}"}
        self._request("POST", "pause", params={"mode": mode, "clear_cache": "false"}, headers=headers)

    def resume_generation(self) -> None:
        self._request("POST", "resume")

    def _sleep_mode_enabled(self) -> bool:
        return bool(self._config["model_config"].get("enable_sleep_mode"))

    def sleep(self, level: int, mode: str) -> None:  # (vLLM's dev-mode routes, as /collective_rpc)
        self._request("POST", "sleep", params={"level": level, "mode": mode})

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._request("POST", "wake_up", params={"tags": list(tags)} if tags is not None else None)

    @cached_property
    def served_model(self) -> str:
        """The model name the server answers to."""
        return str(self._request("GET", "v1/models")["data"][0]["id"])

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any, *, timeout_seconds: float | None = None
    ) -> list[Generation]:
        """Sample through the OpenAI-compatible ``/v1/completions`` route (token-id or text prompts).

        The server needs a tokenizer beside its model for this route. Every field of
        ``sampling_params`` the route accepts is sent (see :func:`completion_fields`).

        The route does not say which weight version produced the first token, so the version
        is read before the request and after it: equal, it is exact; different (a push landed
        meanwhile), each sample carries the earlier one with ``weight_version_exact=False``.
        """
        body = {
            "model": self.adapter.name if self.adapter is not None else self.served_model,
            "prompt": list(prompts),
            "return_token_ids": True,
            **completion_fields(sampling_params),
        }
        before = parse_weight_version(self.get_weight_version())
        timeout = self.generate_timeout_seconds if timeout_seconds is None else timeout_seconds
        response = self._request("POST", "v1/completions", json=body, timeout=timeout)
        exact = parse_weight_version(self.get_weight_version()) == before
        generations = []
        for choice in sorted(response["choices"], key=lambda choice: choice["index"]):
            prompt = list(choice.get("prompt_token_ids") or [])
            prompt_logprobs = None
            if choice.get("prompt_logprobs") is not None:
                entries = choice["prompt_logprobs"][1:]
                prompt_logprobs = [entry[str(token)]["logprob"] for entry, token in zip(entries, prompt[1:])]
            logprobs = None
            if choice.get("logprobs"):
                logprobs = [float(value) for value in choice["logprobs"]["token_logprobs"]]
            generations.append(
                Generation(
                    prompt_token_ids=prompt,
                    token_ids=list(choice.get("token_ids") or []),
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    text=choice.get("text") or None,
                    weight_version=before[0],
                    weight_version_exact=exact,
                    partial_version=before[1],
                )
            )
        return generations


def _json_safe(update_info: dict[str, Any]) -> dict[str, Any]:
    """``update_info`` as JSON: CUDA IPC handles (``ipc`` backend) go pickled in ``ipc_handles_pickled``, as
    vLLM's own ``HTTPVLLMWeightSyncClient`` sends them; the server unpickles them only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the connection checked before the push."""
    handles = update_info.get("ipc_handles")
    if handles is None:
        return update_info
    import base64
    import pickle

    safe = {key: value for key, value in update_info.items() if key != "ipc_handles"}
    safe["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
    return safe


def _server_message(response: Any) -> str:
    """The error message a vLLM (FastAPI) server put in its answer, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return str(response.text[:500]) or response.reason
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("detail", "message", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]
