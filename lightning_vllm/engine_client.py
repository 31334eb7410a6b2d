"""The engine's control plane during a push: every call bounded, the commit window around the call
that finishes an update, and the client a failed push leaves behind.

vLLM's trainer engines drive the engine through a ``VLLMWeightSyncClient`` (start, update,
finish, release). :class:`TimedClient` is that client over an engine target, each call
bounded by ``timeout_seconds`` (``_waits.py``); the one made for a push
(:meth:`TimedClient.committing`) commits its version when the update finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning_vllm._waits import call_with_timeout
from lightning_vllm.errors import WeightSyncError


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
        self,
        client: Any,
        timeout: float,
        weight_version: str | None = None,
        commit_window: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.inner = client
        self.timeout = timeout
        self.weight_version = weight_version
        self.commit_window = commit_window
        self.updates_sent = 0  # update_weights calls made (or tried): a streaming engine may have loaded from any

    def committing(
        self, weight_version: str, commit_window: Callable[[], AbstractContextManager[None]] = nullcontext
    ) -> TimedClient:
        """The same client, whose ``finish_weight_update()`` commits ``weight_version`` inside ``commit_window()``.

        vLLM's trainer engines end an update with ``finish_weight_update()`` and no
        version; a client made for one push lets the engine commit that push's version
        in the same call that finishes the update. ``commit_window`` is entered around
        that call (the connection pauses generation there when the engine loads at finish).
        """
        return TimedClient(self.inner, self.timeout, weight_version, commit_window)

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
        with self.commit_window():
            self._call(
                "finish_weight_update", weight_version, what="vLLM to finish the weight update (finish_weight_update)"
            )

    def update_weights_in_one_call(self, update_on_worker: Callable[..., None], update_info: dict[str, Any]) -> None:
        """Start, load and finish in one call of ``update_on_worker`` on the workers (the inner client is
        ``engines/base.UpdatesInOneCall``), committing this client's version inside ``commit_window()`` as
        ``finish_weight_update`` does."""
        with self.commit_window():
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
        if hasattr(self.inner, "shutdown_weight_transfer_engine"):
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
