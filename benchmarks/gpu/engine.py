"""``ReceiverEngine``: lightning_vllm's ``EngineTarget`` for a receiver process (``receiver.py``).

The trainer's updater talks to it as to any vLLM engine: the facts it checks before a push come
from the receiver's model, and the weight-sync calls are forwarded over a pipe and answered
there; an error raised in the receiver is raised here again, with the receiver's traceback as
its cause. Every wait is bounded, and a call in flight fails at once when the receiver dies.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from receiver import ReceiverSpec, serve
from transformers import PretrainedConfig

from lightning_vllm.engines.base import Generation, PauseMode
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights


class ReceiverDied(RuntimeError):
    """The receiver process ended while a call was waiting for it (or before it was made)."""


class ReceiverError(RuntimeError):
    """Where an error raised in the receiver came from: its message is the receiver's traceback."""


class ReceiverEngine:
    """A receiver process holding a Hugging Face model of ``config``'s shape on ``device``, as an engine target.

    The process starts at construction; :meth:`wait_ready` waits for its model (other calls wait too).

    Args:
        config: the Hugging Face config of the model the receiver serves.
        device: the receiver's device, e.g. ``"cuda:1"``.
        backend: the weight-transfer backend the receiver was "built with" (``"nccl"``, ``"ipc"``, ...).
        seed: the seed of the receiver's own random init.
        stall_update_seconds: the receiver sleeps this long in ``update_weights`` (failure tests).
        start_timeout: the longest the receiver may take to build its model.
        call_timeout: the longest any call may wait for its answer.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        device: str,
        backend: str,
        seed: int = 1000,
        stall_update_seconds: float = 0.0,
        start_timeout: float = 300.0,
        call_timeout: float = 600.0,
    ) -> None:
        self.config = config
        self.device = device
        self.backend = backend
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.update_started = threading.Event()  # set at the first update_weights: failure tests kill after it
        spec = ReceiverSpec(config, device, backend, seed, stall_update_seconds)
        context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child = context.Pipe()
        self._process = context.Process(target=serve, args=(child, spec), name=f"hf-receiver-{backend}", daemon=True)
        self._process.start()
        child.close()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ready: Future[dict[str, Any]] = Future()
        self._pending: dict[int, Future[Any]] = {0: self._ready}
        self._dead = threading.Event()
        threading.Thread(target=self._read_replies, name="receiver-replies", daemon=True).start()

    # -- the pipe -----------------------------------------------------------------

    def _read_replies(self) -> None:
        while True:
            try:
                request_id, ok, result = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(request_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(result)
            else:
                future.set_exception(_remote_error(result))
        self._process.join(timeout=5)
        with self._lock:
            self._dead.set()
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(ReceiverDied(f"{self.description} ended (exit code {self._process.exitcode})"))

    def wait_ready(self) -> dict[str, Any]:
        """The receiver's facts, once its model is built (at most ``start_timeout`` seconds).

        Raises:
            TimeoutError: the model was not built in time.
            ReceiverDied: the receiver ended first; any error of its start-up is raised instead.
        """
        try:
            return self._ready.result(self.start_timeout)
        except FutureTimeout:
            raise TimeoutError(f"{self.description} did not build its model within {self.start_timeout:g} s") from None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.wait_ready()
        future: Future[Any] = Future()
        with self._lock:
            if self._dead.is_set():
                raise ReceiverDied(f"{self.description} has ended (exit code {self._process.exitcode})")
            request_id = next(self._ids)
            self._pending[request_id] = future
            try:
                self._conn.send((request_id, method, args, kwargs))
            except (OSError, ValueError) as error:
                del self._pending[request_id]
                raise ReceiverDied(f"{self.description} is unreachable: {error}") from error
        try:
            return future.result(self.call_timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(request_id, None)
            raise TimeoutError(f"{self.description} did not answer {method} within {self.call_timeout:g} s") from None

    # -- facts ----------------------------------------------------------------------

    @property
    def description(self) -> str:
        return f"HF receiver on {self.device} ({self.backend}, pid {self._process.pid})"

    def transfer_backend(self) -> str | None:
        return self.backend

    def device_type(self) -> str:
        return torch.device(self.device).type

    def tensor_parallel_size(self) -> int:
        return 1

    def num_workers(self) -> int:
        return 1

    def expected_weights(self) -> ExpectedWeights | None:
        facts = self.wait_ready()
        return ExpectedWeights(dict(facts["weights"]), facts["ties_word_embeddings"])

    def is_dead(self) -> bool:
        return self._dead.is_set() or not self._process.is_alive()

    def prompt_limits(self) -> PromptLimits:
        return PromptLimits(
            vocab_size=self.config.vocab_size, max_model_len=self.config.max_position_embeddings, accepts_text=False
        )

    # -- weight sync (vLLM's VLLMWeightSyncClient calls, plus shutdown and the version) -------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.update_started.set()
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str | None:
        return self._call("get_weight_version")

    # -- serving: the receiver does not generate ------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: the receiver holds no KV cache."""

    def pause_generation(self, mode: PauseMode) -> None:
        """Nothing to pause: the receiver does not generate."""

    def resume_generation(self) -> None:
        """Nothing to resume."""

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any, *, timeout_seconds: float | None = None
    ) -> list[Generation]:
        raise ValueError(
            f"{self.description} only loads weights (a Hugging Face model standing in for vLLM's model runner); "
            "it does not generate."
        )

    # -- harness --------------------------------------------------------------------------

    def checksum(self) -> dict[str, Any]:
        """The receiver's per-tensor digests (``hf_models.digest``), by name."""
        return self._call("checksum")

    def state(self) -> dict[str, Any]:
        """The receiver's tensors as ``(dtype, shape, bytes)`` (``hf_models.tensor_from_bytes``); small models only."""
        return self._call("state")

    def stats(self) -> dict[str, Any]:
        """The committed version, the bytes loaded by the last update, whether an update is open."""
        return self._call("stats")

    def raw_broadcast(self, master_address: str, master_port: int, num_bytes: int, rounds: int) -> list[float]:
        """Join a bare ``PyNcclCommunicator`` as rank 1 and receive ``rounds`` broadcasts of ``num_bytes``."""
        return self._call("raw_broadcast", master_address, master_port, num_bytes, rounds)

    def kill(self) -> None:
        """SIGKILL the receiver, as a crash would end it."""
        if self._process.pid is not None and self._process.is_alive():
            try:
                os.kill(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited meanwhile
                pass
        self._process.join(timeout=10)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the receiver to exit, and kill it if it has not within ``timeout`` seconds."""
        if self._process.is_alive() and not self._dead.is_set():
            try:
                with self._lock:
                    self._conn.send((next(self._ids), "close", (), {}))
            except (OSError, ValueError):
                pass
            self._process.join(timeout)
        self.kill()

    def __enter__(self) -> ReceiverEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _remote_error(result: tuple[bytes | None, str, str]) -> BaseException:
    pickled, summary, remote_traceback = result
    try:
        error = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001  # an exception class that does not unpickle
        error = None
    if not isinstance(error, BaseException):
        error = ReceiverError(summary)
    error.__cause__ = ReceiverError(f"raised in the receiver:\n{remote_traceback}")
    return error
