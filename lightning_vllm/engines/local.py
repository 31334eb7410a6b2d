"""A ``vllm.LLM`` in the training process (multiprocess engine core or not), and :class:`InProcessEngine`, what it
shares with an ``AsyncLLM`` there (``async_local.py``): the facts the updater checks, read from the engine's
``VllmConfig``, and what its engine-core client and workers are asked."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.engines.base import (
    ChecksBackgroundPushes,
    ChecksIPCHandles,
    GeneratesOnlyInCalls,
    Generation,
    NamesItsEngine,
    PauseMode,
    ReportsLayerSums,
    ServesAdapter,
    UpdatesInOneCall,
    as_prompt,
    generations_from_outputs,
    parse_weight_version,
)
from lightning_vllm.engines.placement import engine_on_gpus
from lightning_vllm.engines.serialization import ipc_handles_problem
from lightning_vllm.engines.sleep import SleepMode
from lightning_vllm.engines.worker_check import LAYER_SUMS_METHOD, layer_sums_problem
from lightning_vllm.lora.serving import LoraLimits, lora_limits_from
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights, engine_weights


class InProcessEngine(ChecksIPCHandles, NamesItsEngine, ReportsLayerSums, ServesAdapter, SleepMode, UpdatesInOneCall):
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

    description = "in-process engine"  # (each engine class names itself)

    def engine_key(self) -> Hashable:
        return self._key

    def is_dead(self) -> bool:
        return engine_core_died(self._engine_core)

    def ipc_handles_problem(self) -> str | None:
        return ipc_handles_problem(self._engine_core, self.description)

    @abstractmethod
    def _ask_workers(self, method: str) -> list[Any]:
        """Every worker's answer to the worker method ``method`` (``collective_rpc`` by name)."""

    def layer_sums_problem(self) -> str | None:
        return layer_sums_problem(self._ask_workers, self.description)

    def layer_sums(self) -> list[dict[str, Any]]:
        return self._ask_workers(LAYER_SUMS_METHOD)

    def _sleep_mode_enabled(self) -> bool:
        return bool(self._config.model_config.enable_sleep_mode)

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

    description = "in-process vllm.LLM"

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

    def sleep(self, level: int, mode: str) -> None:
        with self._generating:
            self.llm.sleep(level=level, mode=mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        with self._generating:
            self.llm.wake_up(list(tags) if tags is not None else None)

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


def build_local_engine(llm_kwargs: dict[str, Any], gpus: Sequence[int] = ()) -> LocalLLMEngine:
    """Start a ``vllm.LLM`` from its arguments (about 20 s for a tiny model on 2 CPU cores), on ``gpus`` if given
    (``placement.engine_on_gpus``).

    This is how an engine given as a dict of ``vllm.LLM`` arguments (e.g. from a
    LightningCLI YAML file) comes to life on the rank that pushes, with the arguments of
    :func:`local_engine_args`.
    """
    from vllm import LLM

    arguments = local_engine_args(llm_kwargs, gpus, _cuda_available())
    if not gpus:
        return LocalLLMEngine(LLM(**arguments))
    with engine_on_gpus(*gpus):
        return LocalLLMEngine(LLM(**arguments))


def local_engine_args(llm_kwargs: dict[str, Any], gpus: Sequence[int], cuda_available: bool) -> dict[str, Any]:
    """``llm_kwargs`` with what an engine the package builds gets unless they say otherwise: the backend docs/gpu.md's
    table names for where it is (:func:`default_backend`; ``lightning_nccl`` on GPUs of its own), and, on ``gpus``,
    a tensor-parallel size of one rank per GPU.

    Example::

        >>> local_engine_args({"model": "m"}, gpus=(6, 7), cuda_available=True)
        {'weight_transfer_config': {'backend': 'lightning_nccl'}, 'tensor_parallel_size': 2, 'model': 'm'}
        >>> local_engine_args({"model": "m"}, gpus=(), cuda_available=True)
        {'weight_transfer_config': {'backend': 'lightning_ipc'}, 'model': 'm'}
    """
    backend = "lightning_nccl" if gpus else default_backend(cuda_available)
    defaults: dict[str, Any] = {"weight_transfer_config": {"backend": backend}}
    if gpus:
        defaults["tensor_parallel_size"] = len(gpus)
    return {**defaults, **llm_kwargs}


def default_backend(cuda_available: bool) -> str:
    """The backend of an engine the package builds beside the trainer: ``lightning_ipc`` on a GPU (the engine on the
    trainer's GPU, pushes atomic), ``gloo`` on CPUs (docs/gpu.md, "Choose a backend").

    Example::

        >>> default_backend(cuda_available=True), default_backend(cuda_available=False)
        ('lightning_ipc', 'gloo')
    """
    return "lightning_ipc" if cuda_available else "gloo"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
