"""An ``AsyncLLM`` in the training process, driven from the (synchronous) trainer.

``AsyncLLM`` lives on an asyncio event loop. The adapter runs one loop on a
daemon thread (or uses the loop you give it) and submits every call there, so the
trainer's thread can push weights while requests are being served. Around a
transfer the updater pauses generation (see ``PauseMode``), so no request is
served from half-updated weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdatePayload,
    WeightTransferUpdateRequest,
)

from lightning_vllm.engines.base import Generation, PauseMode, as_prompt, generations_from_outputs, parse_weight_version
from lightning_vllm.engines.local import InProcessEngine

_T = TypeVar("_T")

log = logging.getLogger(__name__)


class AsyncLLMEngine(InProcessEngine):
    """Engine target for a ``vllm.v1.engine.async_llm.AsyncLLM``.

    Args:
        async_llm: the engine, built with ``weight_transfer_config={"backend": "gloo"}``.
        loop: the running event loop the engine is used on, if your code already runs one
            in another thread; by default the adapter starts its own on a daemon thread.

    Example::

        >>> from vllm import AsyncEngineArgs  # doctest: +SKIP
        >>> from vllm.v1.engine.async_llm import AsyncLLM  # doctest: +SKIP
        >>> engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path,  # doctest: +SKIP
        ...     weight_transfer_config={"backend": "gloo"}))
        >>> sync = VLLMWeightSync(engine=AsyncLLMEngine(engine))  # doctest: +SKIP
    """

    def __init__(self, async_llm: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(async_llm, async_llm.vllm_config, async_llm.engine_core)
        self.async_llm = async_llm
        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lightning-vllm: AsyncLLM loop", daemon=True).start()
        self.loop = loop

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the engine's loop and wait for it (callers bound the wait)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> Any:
        """Start ``coroutine`` on the engine's loop; returns a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    description = "in-process AsyncLLM"

    def _ask_workers(self, method: str) -> list[Any]:
        return list(self.run(self.async_llm.collective_rpc(method)))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.run(self.async_llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self.run(self.async_llm.start_weight_update())

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.run(self.async_llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.run(self.async_llm.finish_weight_update(weight_version))

    def update_weights_in_one_call(
        self, update_on_worker: Callable[..., None], update_info: dict[str, Any], weight_version: str | None
    ) -> None:
        async def update() -> None:
            await self.async_llm.collective_rpc(update_on_worker, kwargs={"update_info": update_info})
            if weight_version is not None:
                await self.async_llm.update_weight_version(weight_version)

        self.run(update())

    def shutdown_weight_transfer_engine(self) -> None:
        self.run(self.async_llm.shutdown_weight_transfer_engine())

    def get_weight_version(self) -> str | None:
        return self.run(self.async_llm.get_weight_version())

    def reset_prefix_cache(self) -> None:
        # Requests kept across the update ("keep") hold KV computed with the old weights:
        # preempted, they are recomputed with the new ones, and the reset cannot fail on them.
        if not self.run(self.async_llm.reset_prefix_cache(reset_running_requests=True)):
            log.warning("AsyncLLM could not reset its prefix cache after a weight update.")

    def sleep(self, level: int, mode: str) -> None:
        self.run(self.async_llm.sleep(level=level, mode=mode))

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.run(self.async_llm.wake_up(list(tags) if tags is not None else None))

    def pause_generation(self, mode: PauseMode) -> None:
        self.run(self.async_llm.pause_generation(mode=mode, clear_cache=False))

    def resume_generation(self) -> None:
        self.run(self.async_llm.resume_generation())

    async def generate_async(self, prompts: Sequence[list[int] | str], sampling_params: Any) -> list[Generation]:
        """Generate on the engine's loop; all prompts run concurrently."""
        import uuid

        async def one(prompt: list[int] | str) -> Any:
            final = None
            async for output in self.async_llm.generate(
                as_prompt(prompt), sampling_params, request_id=uuid.uuid4().hex, lora_request=self.lora_request()
            ):
                final = output
            return final

        before = parse_weight_version(await self.async_llm.get_weight_version())
        outputs = await asyncio.gather(*(one(prompt) for prompt in prompts))
        after = parse_weight_version(await self.async_llm.get_weight_version())
        return generations_from_outputs(outputs, before, unchanged=after == before)

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any, *, timeout_seconds: float | None = None
    ) -> list[Generation]:
        return self.run(self.generate_async(prompts, sampling_params))
