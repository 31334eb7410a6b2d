"""The engine's control plane during a push: every call bounded, the commit window around the call
that finishes an update, and the client a failed push leaves behind.

vLLM's trainer engines drive the engine through a ``VLLMWeightSyncClient`` (start, update,
finish, release). :class:`TimedClient` is that client over an engine target, each call
bounded by ``timeout_seconds`` (``_waits.py``); the one made for a push
(:meth:`TimedClient.committing`) commits its version when the update finishes, inside the push's
:class:`CommitWindow` (pause, finish, serve the adapter, reset the prefix cache, resume).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from lightning_vllm._waits import BackgroundCall, call_with_timeout
from lightning_vllm.engines.base import EngineTarget, PolicyAdapter, ServesLoraAdapters
from lightning_vllm.engines.failures import raise_if_dead
from lightning_vllm.errors import WeightSyncError


@dataclass
class CommitWindow:
    """One push's window around the engine's commit, and its seconds.

    Generation is paused around the call that finishes (on ``gloo``, loads) the update, or, where the backend
    loads while it receives, around the whole transfer (:meth:`pause` and :meth:`resume`, by the connection). Once
    the update finished, before anything is generated with the new weights, generation is pointed at the adapter
    the update carried (or back at the base model) and the prefix cache is reset. Every call is bounded by
    ``timeout``.

    Args:
        engine: the engine target.
        timeout: the longest each call may take.
        pause_mode: vLLM's ``pause_generation`` mode.
        reset_prefix_cache: reset the prefix cache once the update finished.
        adapter: the LoRA adapter the update carries (``None``: the base model, or merged weights).
        pause_at_finish: pause around the finishing call (the backend loads there).
        pauses: whether the engine generates outside its calls; one that generates only inside them
            (``GeneratesOnlyInCalls``, asked once by the connection) has nothing to pause, and the window is timed
            all the same.
    """

    engine: EngineTarget
    timeout: float
    pause_mode: str
    reset_prefix_cache: bool
    adapter: PolicyAdapter | None = None
    pause_at_finish: bool = True
    pauses: bool = True
    commit_seconds: float = field(default=0.0, init=False)
    pause_seconds: float = field(default=0.0, init=False)
    _paused_at: float | None = field(default=None, init=False, repr=False)

    def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return call_with_timeout(fn, *args, timeout=self.timeout, what=what)

    def pause(self) -> None:
        """Pause generation (timed either way: an engine that generates only inside its calls holds generation for
        the window too)."""
        self._paused_at = time.perf_counter()
        if self.pauses:
            what = f"{self.engine.description} to pause generation"
            self._call(self.engine.pause_generation, self.pause_mode, what=what)

    def resume(self) -> None:
        """Resume generation, if paused."""
        if self.pauses:
            self._call(self.engine.resume_generation, what=f"{self.engine.description} to resume generation")
        if self._paused_at is not None:
            self.pause_seconds += time.perf_counter() - self._paused_at
            self._paused_at = None

    @contextmanager
    def around_finish(self) -> Iterator[None]:
        """Around the call that finishes the update (see the class docstring)."""
        if self.pause_at_finish:
            self.pause()
        started = time.perf_counter()
        try:
            yield
            # A first adapter push, or a merged one after adapter pushes (an engine that cannot serve
            # adapters was sent merged weights only: see adapter_problems).
            engine = self.engine
            if isinstance(engine, ServesLoraAdapters) and engine.adapter != self.adapter:
                self._call(engine.serve_adapter, self.adapter, what=f"{engine.description} to serve the adapter")
            if self.reset_prefix_cache:
                self._call(engine.reset_prefix_cache, what=f"{engine.description} to reset its prefix cache")
            self.commit_seconds = time.perf_counter() - started
        except BaseException:
            if self.pause_at_finish and self.pauses:  # asked without waiting: a frozen engine must not double it
                BackgroundCall(self.engine.resume_generation, what=f"{self.engine.description} to resume generation")
            raise
        if self.pause_at_finish:
            self.resume()


class TimedClient:
    """Wraps a vLLM weight-sync client so that every control call has a timeout.

    Any object with vLLM's ``VLLMWeightSyncClient`` methods can be wrapped; the
    wrapper has the same methods, each bounded by ``timeout`` seconds.

    Args:
        client: the client (an engine target, or any object with the four methods).
        timeout: the longest each call may take.
        weight_version: what ``finish_weight_update()`` commits when called without a
            version, as vLLM's own trainer engines call it; see :meth:`committing`.
    """

    def __init__(
        self, client: Any, timeout: float, weight_version: str | None = None, window: CommitWindow | None = None
    ) -> None:
        self.inner = client
        self.timeout = timeout
        self.weight_version = weight_version
        self.window = window
        self.updates_sent = 0  # update_weights calls made (or tried): a streaming engine may have loaded from any

    def committing(self, weight_version: str, window: CommitWindow | None = None) -> TimedClient:
        """The same client, whose ``finish_weight_update()`` commits ``weight_version`` inside ``window``.

        vLLM's trainer engines end an update with ``finish_weight_update()`` and no
        version; a client made for one push lets the engine commit that push's version
        in the same call that finishes the update, inside the push's :class:`CommitWindow`.
        """
        return TimedClient(self.inner, self.timeout, weight_version, window)

    def raise_if_dead(self) -> None:
        """Raise ``EngineDeadError`` once the push's engine is known to have died (a sender asks while it waits on a
        transfer that cannot see the engine die); a client made for no push has no engine to ask."""
        if self.window is not None:
            raise_if_dead(self.window.engine)

    def _window(self) -> Any:
        return self.window.around_finish() if self.window is not None else nullcontext()

    def _call(self, method: str, *args: Any, what: str) -> Any:
        return call_with_timeout(getattr(self.inner, method), *args, timeout=self.timeout, what=what)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info, what="vLLM to initialise its weight-transfer engine")

    def start_weight_update(self) -> None:
        self._call("start_weight_update", what="vLLM to start a weight update (start_weight_update)")

    def update_weights(self, update_info: Any) -> None:
        self.updates_sent += 1
        self._call("update_weights", update_info, what="vLLM workers to receive and load the weights (update_weights)")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            weight_version = self.weight_version
        with self._window():
            self._call(
                "finish_weight_update", weight_version, what="vLLM to finish the weight update (finish_weight_update)"
            )

    def update_weights_in_one_call(self, update_on_worker: Callable[..., None], update_info: dict[str, Any]) -> None:
        """Start, load and finish in one call of ``update_on_worker`` on the workers (the inner client is
        ``engines/base.UpdatesInOneCall``), committing this client's version inside its commit window as
        ``finish_weight_update`` does."""
        with self._window():
            self._call(
                "update_weights_in_one_call",
                update_on_worker,
                update_info,
                self.weight_version,
                what="vLLM workers to start, load and finish the update (update_weights_in_one_call)",
            )

    def close_open_update(self, weight_version: str | None = None) -> None:
        """``finish_weight_update`` with no commit window: closes an update that received nothing (a no-op load
        on the gloo engine), or one a failed push left open, under ``weight_version`` (``None``: the engine's
        stays)."""
        self._call("finish_weight_update", weight_version, what="vLLM to close an open weight update")

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine", what="vLLM to release its weight-transfer engine")


class AbandonedClient:
    """The client a failed push leaves with vLLM's trainer engine: a transfer thread that outlived its
    push's timeout (a slow source, say) must not reach the engine, whose update was closed meanwhile or
    belongs to the next push. Every call raises."""

    def __init__(self, what: str) -> None:
        self.what = what

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise WeightSyncError(f"{self.what} had already failed; what it sent after that was stopped before the engine.")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse
    update_weights_in_one_call = _refuse

    def shutdown_weight_transfer_engine(self) -> None:
        """Nothing to release: the failure that abandoned this client closed the engine's side."""
