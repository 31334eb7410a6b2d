"""A ``vllm.LLM`` in the training process (multiprocess engine core or not)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.engines.base import Generation, PauseMode, as_prompt, generations_from_outputs
from lightning_vllm.engines.config_facts import EngineConfigFacts, engine_core_died


class LocalLLMEngine(EngineConfigFacts):
    """Adapter for a ``vllm.LLM``.

    ``vllm.LLM`` is synchronous: generation and weight updates run one after the
    other, so there is nothing to pause. Its calls are not thread-safe, and a background
    push (``blocking=False``) calls it from another thread than the training loop's
    generate: one lock orders every call, so a commit waits for a generate in progress
    (and the next generate for the commit) while the bytes of the push keep moving.

    Example::

        >>> from vllm import LLM  # doctest: +SKIP
        >>> llm = LLM(model=path, weight_transfer_config={"backend": "gloo"})  # doctest: +SKIP
        >>> LocalLLMEngine(llm).transfer_backend()  # doctest: +SKIP
        'gloo'
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._config = llm.llm_engine.vllm_config
        self._lock = threading.RLock()

    @property
    def description(self) -> str:
        return "in-process vllm.LLM"

    def is_dead(self) -> bool:
        return engine_core_died(self.llm.llm_engine.engine_core)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        with self._lock:
            self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        with self._lock:
            self.llm.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        with self._lock:
            self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._lock:
            self.llm.finish_weight_update(weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        with self._lock:
            self.llm.shutdown_weight_transfer_engine()

    def get_weight_version(self) -> str | None:
        with self._lock:
            return self.llm.get_weight_version()

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.llm.reset_prefix_cache()

    def pause_generation(self, mode: PauseMode) -> None:
        """Nothing to pause: ``vllm.LLM`` generates only inside ``generate`` calls."""

    def resume_generation(self) -> None:
        """Nothing to resume."""

    def generate(self, prompts: Sequence[list[int] | str], sampling_params: Any) -> list[Generation]:
        with self._lock:  # the version read is the one the tokens came from
            outputs = self.llm.generate(
                [as_prompt(p) for p in prompts], sampling_params, use_tqdm=False, lora_request=self.lora_request()
            )
            return generations_from_outputs(outputs, self.get_weight_version())


def build_local_engine(llm_kwargs: dict[str, Any]) -> LocalLLMEngine:
    """Start a ``vllm.LLM`` from its arguments (about 20 s for a tiny model on 2 CPU cores).

    This is how an engine given as a dict of ``vllm.LLM`` arguments (e.g. from a
    LightningCLI YAML file) comes to life on the rank that pushes.
    """
    from vllm import LLM

    return LocalLLMEngine(LLM(**llm_kwargs))
