"""Where vLLM lives: one engine target per kind of engine the trainer talks to.

An engine target (:class:`EngineTarget`) answers what the updater must know before any
byte moves (backend, number of workers, device, the weights the model loads),
exposes vLLM's weight-sync control plane, versions, the prefix cache, pausing, and
one way to generate (:meth:`EngineTarget.generate`) whatever the target.
"""

from __future__ import annotations

from typing import Any

from lightning_vllm.engines.async_local import AsyncLLMEngine
from lightning_vllm.engines.base import EngineTarget, Generation, PauseMode
from lightning_vllm.engines.http import HTTPEngine
from lightning_vllm.engines.local import LocalLLMEngine
from lightning_vllm.engines.ray import RayEngine, VLLMActor, is_actor_handle

__all__ = [
    "AsyncLLMEngine",
    "EngineTarget",
    "Generation",
    "HTTPEngine",
    "LocalLLMEngine",
    "PauseMode",
    "RayEngine",
    "VLLMActor",
    "as_engine_target",
    "as_engine_targets",
]


def as_engine_target(engine: Any) -> EngineTarget:
    """Wrap what the user passed as ``engine`` in its engine target.

    Accepts a ``vllm.LLM``, an ``AsyncLLM``, a server URL (``"http://host:port"``), a
    Ray actor handle of :class:`VLLMActor`, or a ready :class:`EngineTarget`.

    Raises:
        TypeError: for an object that is no supported engine.
    """
    if isinstance(engine, EngineTarget):
        return engine
    if isinstance(engine, str):
        return HTTPEngine(engine)
    if is_actor_handle(engine):
        return RayEngine(engine)
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM

    if isinstance(engine, LLM):
        return LocalLLMEngine(engine)
    if isinstance(engine, AsyncLLM):
        return AsyncLLMEngine(engine)
    raise TypeError(
        f"Unsupported engine {type(engine).__name__}: pass a vllm.LLM or AsyncLLM built with "
        "weight_transfer_config={'backend': 'gloo'} (on GPUs 'lightning_ipc' beside the trainer, 'lightning_nccl' on "
        "GPUs of its own: docs/gpu.md), a server URL such as "
        "'http://127.0.0.1:8000', or a Ray actor handle of lightning_vllm.VLLMActor."
    )


def as_engine_targets(engine: Any) -> list[EngineTarget]:
    """Like :func:`as_engine_target`, for one engine or a list of them."""
    engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
    return [as_engine_target(item) for item in engines]
