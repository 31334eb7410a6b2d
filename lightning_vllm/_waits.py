"""Bounded waits: run a blocking call and give up after a timeout.

vLLM's control calls (``collective_rpc`` of an in-process engine, an HTTP request,
a Ray ``get``) can block forever when the other side is gone. Running them on a
daemon thread lets the caller stop waiting with a clear error; the orphaned
thread cannot keep the interpreter alive at exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError

_T = TypeVar("_T")


class BackgroundCall(Generic[_T]):
    """A call running on a daemon thread whose result is awaited with a timeout."""

    def __init__(self, fn: Callable[..., _T], *args: Any, what: str, **kwargs: Any) -> None:
        self.what = what
        self._result: _T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(fn, args, kwargs), name=f"lightning-vllm: {what}", daemon=True
        )
        self._thread.start()

    def _run(self, fn: Callable[..., _T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._result = fn(*args, **kwargs)
        except BaseException as error:  # re-raised in the waiting thread by result()
            self._error = error
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the call has returned or raised."""
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the call to end; whether it did (its outcome is not raised)."""
        return self._done.wait(timeout)

    def result(self, timeout: float, hint: str = "") -> _T:
        """Wait at most ``timeout`` seconds and return the call's result or raise its error.

        Raises:
            WeightSyncTimeoutError: the call did not finish in time.
        """
        if not self._done.wait(timeout):
            raise WeightSyncTimeoutError(
                f"Timed out after {timeout:g} s waiting for {self.what}. "
                + (hint or "Check that the vLLM engine is alive and reachable, or raise timeout_seconds.")
            )
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def call_with_timeout(
    fn: Callable[..., _T], *args: Any, timeout: float, what: str, hint: str = "", **kwargs: Any
) -> _T:
    """Run ``fn(*args, **kwargs)`` and wait for it at most ``timeout`` seconds.

    Raises:
        WeightSyncTimeoutError: ``fn`` did not return in time (it keeps running on a daemon thread).
    """
    return BackgroundCall(fn, *args, what=what, **kwargs).result(timeout, hint)


def call_watched(
    fn: Callable[[], _T], *, timeout: float, what: str, check: Callable[[], None], interval: float, hint: str = ""
) -> _T:
    """Like :func:`call_with_timeout`, asking ``check()`` every ``interval`` seconds while ``fn`` runs:
    ``check`` raises to end the wait early (the other side is known to be gone)."""
    call = BackgroundCall(fn, what=what)
    deadline = time.monotonic() + timeout
    while not call.wait(interval) and time.monotonic() < deadline:
        check()
    return call.result(max(0.0, deadline - time.monotonic()), hint)


def wait_polling(
    done: Callable[[], bool],
    *,
    timeout: float,
    interval: float,
    timeout_error: Callable[[], BaseException],
    check: Callable[[], None] = lambda: None,
) -> None:
    """Poll ``done()`` every ``interval`` seconds until it is true, for at most ``timeout`` seconds.

    ``check()`` runs at every poll and may raise to end the wait early (e.g. the
    other side of a transfer failed); ``timeout_error()`` builds what is raised
    when time runs out.
    """
    deadline = time.monotonic() + timeout
    while not done():
        check()
        if time.monotonic() > deadline:
            raise timeout_error()
        time.sleep(interval)


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
        self._call("update_weights", update_info, what="vLLM workers to receive and load the weights (update_weights)")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            weight_version = self.weight_version
        with self.commit_window():
            self._call(
                "finish_weight_update", weight_version, what="vLLM to finish the weight update (finish_weight_update)"
            )

    def close_open_update(self) -> None:
        """``finish_weight_update`` with no version and no commit window: closes an update
        that received nothing (a no-op load on the gloo engine)."""
        self._call("finish_weight_update", None, what="vLLM to close an open weight update")

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
