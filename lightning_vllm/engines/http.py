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

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from lightning_vllm.engines.base import Generation, PauseMode
from lightning_vllm.errors import EngineConfigError, WeightSyncError
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights, checkpoint_weights

SERVER_COMMAND = 'VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config \'{"backend": "gloo"}\''


class HTTPEngine:
    """Adapter for a vLLM server.

    Args:
        base_url: the server's address, e.g. ``"http://127.0.0.1:8000"``.
        timeout_seconds: the longest one HTTP request may take.

    Example::

        >>> engine = HTTPEngine("http://127.0.0.1:8000")  # doctest: +SKIP
        >>> engine.transfer_backend()  # doctest: +SKIP
        'gloo'
    """

    def __init__(self, base_url: str, timeout_seconds: float = 120.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"Invalid engine URL {base_url!r}: expected e.g. 'http://127.0.0.1:8000'.")
        self.base_url = base_url.rstrip("/")
        self.timeout_seconds = timeout_seconds
        self._sync = HTTPVLLMWeightSyncClient(self.base_url, timeout=timeout_seconds)

    @property
    def description(self) -> str:
        return f"vLLM server at {self.base_url}"

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import requests

        url = f"{self.base_url}/{path.lstrip('/')}"
        try:
            response = requests.request(method, url, timeout=self.timeout_seconds, **kwargs)
        except requests.ConnectionError as error:
            raise WeightSyncError(
                f"Cannot reach the vLLM server at {self.base_url} ({type(error).__name__}). Check the URL and that the "
                f"server is running, e.g. {SERVER_COMMAND}"
            ) from error
        except requests.Timeout as error:
            raise WeightSyncError(
                f"The vLLM server at {self.base_url} did not answer {path} within {self.timeout_seconds:g} s."
            ) from error
        if response.status_code == 404:
            raise EngineConfigError(
                f"{url} does not exist: the server is not a vLLM server in dev mode. Start it with {SERVER_COMMAND}"
            )
        if not response.ok:
            raise WeightSyncError(
                f"The vLLM server at {self.base_url} answered {path} with {response.status_code}: {response.text[:500]}"
            )
        return response.json() if response.content else None

    @cached_property
    def _config(self) -> dict[str, Any]:
        info = self._request("GET", "server_info", params={"config_format": "json"})
        return dict(info["vllm_config"])

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
    def _model_dir_config(self) -> dict[str, Any] | None:
        """The served model's ``config.json``, readable when the server runs on this machine
        (or shares its file system); ``None`` otherwise."""
        config_file = Path(str(self._config["model_config"]["model"])) / "config.json"
        return dict(json.loads(config_file.read_text())) if config_file.is_file() else None

    def expected_weights(self) -> ExpectedWeights | None:
        model_config, hf_config = self._config["model_config"], self._model_dir_config
        if hf_config is None:
            return None
        ties = bool(hf_config.get("tie_word_embeddings", False))
        dtype = getattr(torch, str(model_config["dtype"]).removeprefix("torch."))
        return checkpoint_weights(model_config["model"], serving_dtype=dtype, ties_word_embeddings=ties)

    def is_dead(self) -> bool:
        """A server that is gone refuses connections, which each request reports at once."""
        return False

    def prompt_limits(self) -> PromptLimits:
        model_config, hf_config = self._config["model_config"], self._model_dir_config
        vocab_size = (hf_config or {}).get("vocab_size")
        return PromptLimits(
            vocab_size=int(vocab_size) if vocab_size is not None else None,
            max_model_len=int(model_config["max_model_len"]),
            accepts_text=not model_config.get("skip_tokenizer_init", False),
        )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._sync.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._sync.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._sync.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._sync.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._sync.shutdown_weight_transfer_engine()

    def get_weight_version(self) -> str | None:
        return self._request("GET", "weight_info")["weight_version"]

    def reset_prefix_cache(self) -> None:
        self._request("POST", "reset_prefix_cache")

    def pause_generation(self, mode: PauseMode) -> None:
        self._request("POST", "pause", params={"mode": mode, "clear_cache": "false"})

    def resume_generation(self) -> None:
        self._request("POST", "resume")

    @cached_property
    def served_model(self) -> str:
        """The model name the server answers to."""
        return str(self._request("GET", "v1/models")["data"][0]["id"])

    def generate(self, prompts: Sequence[list[int] | str], sampling_params: Any) -> list[Generation]:
        """Sample through the OpenAI-compatible ``/v1/completions`` route (token-id or text prompts).

        The server needs a tokenizer beside its model for this route.
        """
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": list(prompts),
            "max_tokens": sampling_params.max_tokens,
            "temperature": sampling_params.temperature,
            "top_p": sampling_params.top_p,
            "n": sampling_params.n,
            "seed": sampling_params.seed,
            "return_token_ids": True,
        }
        if sampling_params.logprobs is not None:
            body["logprobs"] = sampling_params.logprobs
        if sampling_params.prompt_logprobs is not None:
            body["prompt_logprobs"] = sampling_params.prompt_logprobs
        response = self._request("POST", "v1/completions", json=body)
        version = self.get_weight_version()
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
                    weight_version=version,
                )
            )
        return generations
