"""A ``vllm.LLM`` in the training process (multiprocess engine core or not)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.engines.base import (
    ChecksBackgroundPushes,
    GeneratesOnlyInCalls,
    Generation,
    PauseMode,
    as_prompt,
    generations_from_outputs,
    parse_weight_version,
)
from lightning_vllm.engines.in_process import InProcessEngine


class LocalLLMEngine(InProcessEngine, ChecksBackgroundPushes, GeneratesOnlyInCalls):
    """Engine target for a ``vllm.LLM``.

    ``vllm.LLM`` generates only inside ``generate`` calls, so there is nothing to pause.
    A background push (``blocking=False``) calls the engine from another thread than the
    training loop's generate: the update's control calls go through the engine core's
    request socket, which the adapter guards with a lock (vLLM's client has none), and
    the commit waits for a ``generate`` of this target in progress (and the next one for
    the commit), so its samples carry one version. ``llm.generate`` called directly may
    see a commit between two of its steps; vLLM then reports both versions per token.

    Example::

        >>> from vllm import LLM  # doctest: +SKIP
        >>> llm = LLM(model=path, weight_transfer_config={"backend": "gloo"})  # doctest: +SKIP
        >>> LocalLLMEngine(llm).transfer_backend()  # doctest: +SKIP
        'gloo'
    """

    def __init__(self, llm: Any) -> None:
        super().__init__(llm, llm.llm_engine.vllm_config, llm.llm_engine.engine_core)
        self.llm = llm
        self._generating = threading.RLock()
        self._thread_safe = _guard_request_socket(llm.llm_engine.engine_core)

    @property
    def description(self) -> str:
        return "in-process vllm.LLM"

    def background_push_problem(self) -> str | None:
        """Why a push may not run on another thread than generation (``None``: it may)."""
        if self._thread_safe:
            return None
        return (
            "this vllm.LLM runs its engine core in the training process (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
            "which only one thread may drive"
        )

    def _ask_workers(self, method: str) -> list[Any]:
        return list(self.llm.collective_rpc(method))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._generating:
            self.llm.finish_weight_update(weight_version=weight_version)

    def update_weights_in_one_call(
        self, update_on_worker: Callable[..., None], update_info: dict[str, Any], weight_version: str | None
    ) -> None:
        with self._generating:  # (it finishes the update, as finish_weight_update)
            self.llm.collective_rpc(update_on_worker, kwargs={"update_info": update_info})
            if weight_version is not None:
                self.llm.update_weight_version(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def get_weight_version(self) -> str | None:
        return self.llm.get_weight_version()

    def reset_prefix_cache(self) -> None:
        with self._generating:
            self.llm.reset_prefix_cache()

    def generates_only_in_calls(self) -> bool:
        return True

    def pause_generation(self, mode: PauseMode) -> None:
        """Nothing to pause: ``vllm.LLM`` generates only inside ``generate`` calls."""

    def resume_generation(self) -> None:
        """Nothing to resume."""

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any, *, timeout_seconds: float | None = None
    ) -> list[Generation]:
        with self._generating:  # no commit in between: the version read is the one the tokens came from
            reported = parse_weight_version(self.get_weight_version())
            outputs = self.llm.generate(
                [as_prompt(p) for p in prompts], sampling_params, use_tqdm=False, lora_request=self.lora_request()
            )
            return generations_from_outputs(outputs, reported)


def _guard_request_socket(client: Any) -> bool:
    """Serialize what a multiprocess engine-core client sends on its request socket (a zmq socket,
    which two threads must not use at once); whether the client is now safe to call from two threads.

    Idempotent: an engine wrapped by several adapters gets one lock.
    """
    send: Callable[..., Any] | None = getattr(client, "_send_input", None)
    if send is None:  # the in-process client runs the engine core in the calling thread
        return False
    if getattr(send, "lightning_vllm_lock", None) is not None:
        return True
    lock = threading.Lock()

    def send_one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return send(*args, **kwargs)

    send_one_at_a_time.lightning_vllm_lock = lock  # type: ignore[attr-defined]
    client._send_input = send_one_at_a_time
    return True


def build_local_engine(llm_kwargs: dict[str, Any]) -> LocalLLMEngine:
    """Start a ``vllm.LLM`` from its arguments (about 20 s for a tiny model on 2 CPU cores).

    This is how an engine given as a dict of ``vllm.LLM`` arguments (e.g. from a
    LightningCLI YAML file) comes to life on the rank that pushes.
    """
    from vllm import LLM

    return LocalLLMEngine(LLM(**llm_kwargs))
