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
from typing import Any, Generic, TypeVar

from lightning_vllm.errors import WeightSyncTimeoutError

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
