"""Where vLLM lives: one adapter per kind of engine the trainer talks to.

An adapter answers what the updater must know about an engine before any byte
moves (which weight-transfer backend it was built with, how many workers join
the group, on which device) and exposes vLLM's weight-sync control plane (the
four calls of ``VLLMWeightSyncClient``) plus versions and the prefix cache.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.weights.checks import ExpectedWeights, checkpoint_weights


@runtime_checkable
class EngineTarget(Protocol):
    """What the updater needs from a vLLM engine, wherever it runs."""

    @property
    def description(self) -> str:
        """A short human name for messages, e.g. ``"in-process vllm.LLM"``."""
        ...

    def transfer_backend(self) -> str | None:
        """The weight-transfer backend the engine was built with, ``None`` if none."""
        ...

    def device_type(self) -> str:
        """vLLM's device type: ``"cpu"``, ``"cuda"``, ..."""
        ...

    def tensor_parallel_size(self) -> int: ...

    def num_workers(self) -> int:
        """Worker processes that join the transfer group (TP x PP x DP)."""
        ...

    def expected_weights(self) -> ExpectedWeights | None:
        """What the engine's model loads (names, serving dtypes, shapes), ``None`` if unknown."""
        ...

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...

    def get_weight_version(self) -> str | None: ...

    def reset_prefix_cache(self) -> None: ...


class LocalLLMEngine:
    """A ``vllm.LLM`` in the training process (multiprocess engine core or not).

    Example::

        >>> from vllm import LLM  # doctest: +SKIP
        >>> llm = LLM(model=path, weight_transfer_config={"backend": "gloo"})  # doctest: +SKIP
        >>> LocalLLMEngine(llm).transfer_backend()  # doctest: +SKIP
        'gloo'
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._config = llm.llm_engine.vllm_config

    @property
    def description(self) -> str:
        return "in-process vllm.LLM"

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
        return checkpoint_weights(
            model_config.model,
            serving_dtype=model_config.dtype,
            ties_word_embeddings=bool(getattr(model_config.hf_config, "tie_word_embeddings", False)),
        )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def get_weight_version(self) -> str | None:
        return self.llm.get_weight_version()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def as_engine_target(engine: Any) -> EngineTarget:
    """Wrap what the user passed as ``engine`` in its adapter.

    Raises:
        TypeError: for an object that is no supported engine.
    """
    if isinstance(engine, EngineTarget):
        return engine
    from vllm import LLM

    if isinstance(engine, LLM):
        return LocalLLMEngine(engine)
    raise TypeError(
        f"Unsupported engine {type(engine).__name__}: pass a vllm.LLM built with "
        "weight_transfer_config={'backend': 'gloo'} (or 'nccl' on GPUs)."
    )
