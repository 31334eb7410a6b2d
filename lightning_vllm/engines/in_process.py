"""What the engines in the training process (``vllm.LLM``, ``AsyncLLM``) share: the facts the updater checks, read
from the engine's ``VllmConfig``, and what its engine-core client and workers are asked."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

from lightning_vllm.engines.base import (
    ChecksIPCHandles,
    NamesItsEngine,
    ReportsLayerSums,
    ServesAdapter,
    UpdatesInOneCall,
)
from lightning_vllm.engines.serialization import ipc_handles_problem
from lightning_vllm.engines.worker_check import LAYER_SUMS_METHOD, layer_sums_problem
from lightning_vllm.lora.serving import LoraLimits, lora_limits_from
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights, engine_weights


class InProcessEngine(ChecksIPCHandles, NamesItsEngine, ReportsLayerSums, ServesAdapter, UpdatesInOneCall):
    """An engine in the training process: what the updater checks, read from its ``VllmConfig``; whether it died
    or carries CUDA IPC handles, asked of its engine-core client; its workers' per-layer sums, asked by name
    through its ``collective_rpc`` (:meth:`_ask_workers`).

    Args:
        engine: the ``vllm.LLM`` or ``AsyncLLM`` (what :meth:`engine_key` names).
        config: its ``VllmConfig``.
        engine_core: its engine-core client.
    """

    def __init__(self, engine: Any, config: Any, engine_core: Any) -> None:
        self._config = config
        self._engine_core = engine_core
        self._key = (type(self).__name__, id(engine))

    @property
    def description(self) -> str:
        return "in-process engine"  # (each engine class names itself)

    def engine_key(self) -> Hashable:
        return self._key

    def is_dead(self) -> bool:
        return engine_core_died(self._engine_core)

    def ipc_handles_problem(self) -> str | None:
        return ipc_handles_problem(self._engine_core, self.description)

    @abstractmethod
    def _ask_workers(self, method: str) -> Sequence[Any]:
        """Every worker's answer to the worker method ``method`` (``collective_rpc`` by name)."""

    def layer_sums_problem(self) -> str | None:
        return layer_sums_problem(self._ask_workers, self.description)

    def layer_sums(self) -> list[dict[str, Any]]:
        return list(self._ask_workers(LAYER_SUMS_METHOD))

    def transfer_backend(self) -> str | None:
        config = self._config.weight_transfer_config
        return None if config is None else str(config.backend)

    def device_type(self) -> str:
        return str(self._config.device_config.device_type)

    def tensor_parallel_size(self) -> int:
        return int(self._config.parallel_config.tensor_parallel_size)

    def num_workers(self) -> int:
        parallel = self._config.parallel_config
        return int(parallel.world_size * parallel.data_parallel_size)

    def expected_weights(self) -> ExpectedWeights | None:
        model_config = self._config.model_config
        ties = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        return engine_weights(
            str(model_config.model),
            serving_dtype=model_config.dtype,
            ties_word_embeddings=ties,
            hf_config=model_config.hf_config,
            revision=model_config.revision,
            download_dir=self._config.load_config.download_dir,
        )

    def lora_limits(self) -> LoraLimits | None:
        return lora_limits_from(self._config.lora_config)

    def prompt_limits(self) -> PromptLimits:
        model_config = self._config.model_config
        return PromptLimits(
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            accepts_text=not model_config.skip_tokenizer_init,
        )


def engine_core_died(engine_core: Any) -> bool:
    """Whether vLLM's client has seen its engine-core process exit.

    vLLM's monitor thread sets the flag, but a call already waiting for the core's
    output is not woken up: it would wait forever, so callers ask here while they wait.
    An in-process core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no process to lose.
    """
    return bool(getattr(getattr(engine_core, "resources", None), "engine_dead", False))
