"""Bounded waits: run a blocking call and give up after a timeout.

vLLM's control calls (``collective_rpc`` of an in-process engine, an HTTP request,
a Ray ``get``) can block forever when the other side is gone. Running them on a
daemon thread lets the caller stop waiting with a clear error; the orphaned
thread cannot keep the interpreter alive at exit.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lightning_vllm.errors import WeightSyncTimeoutError

_T = TypeVar("_T")


class BackgroundCall(Generic[_T]):
    """A call running on a daemon thread whose result is awaited with a timeout.

    The thread comes from a small pool of idle ones (:class:`_Caller`): a push makes half a dozen bounded
    calls, and starting a thread for each cost about a tenth of a millisecond, a push of an 8B model over
    ``lightning_ipc`` taking ten (docs/runs.md). A call that never returns keeps its thread; the next call
    gets another.
    """

    def __init__(
        self, fn: Callable[..., _T], *args: Any, what: str, waited_until: float | None = None, **kwargs: Any
    ) -> None:
        self.what = what
        self.waited_until = waited_until  # (time.monotonic) when its waiter gives up, if it says; see _watched
        self._result: _T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        _Caller.take().hand(self, fn, args, kwargs)

    def _run(self, fn: Callable[..., _T], args: tuple[Any, ...], kwargs: dict[str, Any], caller: _Caller) -> None:
        _watched.until = self.waited_until
        try:
            self._result = fn(*args, **kwargs)
        except BaseException as error:  # re-raised in the waiting thread by result()
            self._error = error
        finally:
            _watched.until = None
            caller.idle()  # (first: a caller woken below may hand it its next call)
            self._done.set()

    def done(self) -> bool:
        """Whether the call has returned or raised."""
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the call to end; whether it did (its outcome is not raised)."""
        return self._done.wait(timeout)

    def result(self, timeout: float, hint: str = "", waited: float | None = None) -> _T:
        """Wait at most ``timeout`` seconds and return the call's result or raise its error.

        ``waited`` is how long the caller has waited for the call in all, when it waited before this (the timeout
        error says so; by default ``timeout``).

        Raises:
            WeightSyncTimeoutError: the call did not finish in time.
        """
        if not self._done.wait(timeout):
            raise WeightSyncTimeoutError(
                f"Timed out after {timeout if waited is None else waited:g} s waiting for {self.what}. "
                + (hint or "Check that the vLLM engine is alive and reachable, or raise timeout_seconds.")
            )
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class _Caller(threading.Thread):
    """A daemon thread that runs the calls handed to it, one at a time, named after the one it runs; idle, it
    waits in a pool of at most ``_MAX_IDLE`` for the next (thread-local state, a CUDA stream set and not
    restored say, would carry over: the calls of this package restore what they set)."""

    _pool: list[_Caller] = []
    _lock = threading.Lock()
    _MAX_IDLE = 8

    def __init__(self) -> None:
        super().__init__(name=_IDLE, daemon=True)
        self._calls: queue.SimpleQueue[tuple[BackgroundCall[Any], Callable[..., Any], tuple, dict] | None] = (
            queue.SimpleQueue()
        )
        self.start()

    @classmethod
    def take(cls) -> _Caller:
        """An idle caller, or a new one."""
        with cls._lock:
            while cls._pool:
                caller = cls._pool.pop()
                if caller.is_alive():
                    return caller
        return cls()

    def hand(self, call: BackgroundCall[Any], fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self._calls.put((call, fn, args, kwargs))

    def idle(self) -> None:
        """Back to the pool (or, the pool full, let the thread end)."""
        self.name = _IDLE
        with self._lock:
            if len(self._pool) < self._MAX_IDLE:
                self._pool.append(self)
                return
        self._calls.put(None)

    def run(self) -> None:
        while (handed := self._calls.get()) is not None:
            call, fn, args, kwargs = handed
            self.name = f"lightning-vllm: {call.what}"
            call._run(fn, args, kwargs, self)


_IDLE = "lightning-vllm: idle caller"
# On a caller's thread, ``until``: when the waiter of the call it runs gives up (None: no waiter says).
_watched = threading.local()
# A forked child has none of the parent's threads: its pool starts empty.
os.register_at_fork(after_in_child=_Caller._pool.clear)


def call_with_timeout(
    fn: Callable[..., _T], *args: Any, timeout: float, what: str, hint: str = "", **kwargs: Any
) -> _T:
    """Run ``fn(*args, **kwargs)`` and wait for it at most ``timeout`` seconds.

    A call made on the thread of a bounded call whose waiter gives up no later than this wait would (a transfer's
    control calls, inside ``call_watched``) runs right here: a thread of its own would bound nothing more, and each
    hand-off to another thread costs a context switch, about 0.1 ms here and several times that on a GPU host's
    busy CPU (docs/runs.md). The waiter's own timeout, and its error, stand for it.

    Raises:
        WeightSyncTimeoutError: ``fn`` did not return in time (it keeps running on a daemon thread).
    """
    until = time.monotonic() + timeout
    watched_until = getattr(_watched, "until", None)
    if watched_until is not None and watched_until <= until:
        return fn(*args, **kwargs)
    return BackgroundCall(fn, *args, what=what, waited_until=until, **kwargs).result(timeout, hint)


def call_watched(
    fn: Callable[[], _T], *, timeout: float, what: str, check: Callable[[], None], interval: float, hint: str = ""
) -> _T:
    """Like :func:`call_with_timeout`, asking ``check()`` every ``interval`` seconds while ``fn`` runs:
    ``check`` raises to end the wait early (the other side is known to be gone)."""
    deadline = time.monotonic() + timeout
    call = BackgroundCall(fn, what=what, waited_until=deadline)
    while not call.wait(interval) and time.monotonic() < deadline:
        check()
    return call.result(max(0.0, deadline - time.monotonic()), hint, waited=timeout)


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
