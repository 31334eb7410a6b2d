"""The facts the updater checks, read from an in-process engine's ``VllmConfig``."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from lightning_vllm.engines.base import ServesAdapter
from lightning_vllm.engines.worker_check import layer_sums_problem
from lightning_vllm.lora.serving import LoraLimits, lora_limits_from
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights, engine_weights


class EngineConfigFacts(ServesAdapter):
    """What the updater checks, read from an in-process engine's ``VllmConfig`` (``self._config``), and
    its workers' per-layer sums, asked by name through the engine's ``collective_rpc`` (:meth:`_ask_workers`)."""

    _config: Any

    @property
    def description(self) -> str:
        return "in-process engine"  # (each engine class names itself)

    @abstractmethod
    def _ask_workers(self, method: str) -> Sequence[Any]:
        """Every worker's answer to the worker method ``method`` (``collective_rpc`` by name)."""

    def layer_sums_problem(self) -> str | None:
        return layer_sums_problem(self._ask_workers, self.description)

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
