"""vLLM's sleep mode, as pushes and rollouts meet it: what an engine's sleep left, and what each side does about it.

Colocated RL puts vLLM to sleep while the trainer steps (``sleep(level=1)`` keeps a host copy of the weights and
frees their GPU memory and the KV cache's; ``sleep(level=2)`` drops both) and wakes it for a push and for rollouts.
vLLM reports only "sleeping or not", keeps reporting the last weight version after a level-2 sleep whose weights are
gone, and crashes its engine core on a push into a sleeping engine (vLLM 57853). So:

- every worker notes what its sleep did (``in_vllm/worker_methods.py``), and :class:`SleepState` is what they report;
- :class:`SleepMode` is the capability of an engine target that can sleep;
- a push first wakes the weights (:func:`wake_for_push`): vLLM's push never meets a sleeping engine, and weights
  dropped since the last push make that push send every layer; afterwards (:func:`after_push`) an engine the user put
  at level 1 goes back to it, and the KV cache stays asleep until rollouts;
- rollouts first wake the engine (:func:`wake_for_rollouts`) and refuse to sample from dropped weights;
- the callback's ``sleep_level`` puts engines to sleep before backward (:func:`put_to_sleep`).

Engines built without ``enable_sleep_mode=True`` are never asked anything here: their pushes and rollouts cost
nothing more.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_vllm._waits import call_with_timeout
from lightning_vllm.engines.base import EngineTarget
from lightning_vllm.errors import EngineConfigError, WeightSyncError
from lightning_vllm.in_vllm.worker_methods import SLEEP_STATE_METHOD
from lightning_vllm.options import SleepLevel

log = logging.getLogger(__name__)


class WeightsDroppedError(WeightSyncError):
    """An engine's weights were dropped (a level-2 sleep, or a discard) and no push has landed since: it would
    serve whatever its freshly mapped memory holds."""


@dataclass(frozen=True)
class SleepState:
    """What vLLM's sleep mode left on an engine's workers (``in_vllm/worker_methods.sleep_state``).

    Attributes:
        asleep: the memory tags asleep on some worker (``"weights"``, ``"kv_cache"``).
        level: the level of the workers' last sleep (0: never slept).
        dropped: how many times the workers dropped their weights (level 2 or a discard): a count, so that a drop
            the trainer never saw (the user's ``sleep(2)`` then ``wake_up()``) is still noticed.

    Example::

        >>> state = SleepState.of_workers([{"asleep": ["kv_cache", "weights"], "level": 2, "dropped": 1}])
        >>> state.weights_asleep, state.kv_cache_asleep, state.dropped
        (True, True, 1)
    """

    asleep: frozenset[str] = frozenset()
    level: int = 0
    dropped: int = 0

    @classmethod
    def of_workers(cls, reports: Sequence[dict[str, Any]]) -> SleepState:
        """One state of every worker's report (their sleeps are the executor's, so they agree)."""
        return cls(
            frozenset(tag for report in reports for tag in report["asleep"]),
            max((int(report["level"]) for report in reports), default=0),
            max((int(report["dropped"]) for report in reports), default=0),
        )

    @property
    def weights_asleep(self) -> bool:
        return "weights" in self.asleep

    @property
    def kv_cache_asleep(self) -> bool:
        return "kv_cache" in self.asleep


class SleepMode(ABC):
    """What every engine target that can sleep shares: it asks its workers what their sleep left, and remembers how
    many weight drops the last push that landed had seen (``dropped_at_last_push``; ``None``: no push yet), which
    tells weights a push refilled from dropped ones.

    Subclasses say whether the engine was built with sleep mode, and make vLLM's three calls.
    """

    description: str
    dropped_at_last_push: int | None = None

    def dropped_since_last_push(self, state: SleepState) -> bool:
        """Whether ``state`` tells of weights dropped since the last push that landed (before any push: ever)."""
        return state.dropped != (self.dropped_at_last_push or 0)

    @abstractmethod
    def _sleep_mode_enabled(self) -> bool:
        """Whether the engine was built with ``enable_sleep_mode=True``."""

    @abstractmethod
    def _ask_workers(self, method: str) -> list[Any]: ...

    @abstractmethod
    def sleep(self, level: int, mode: str) -> None:
        """vLLM's ``sleep(level, mode)``: requests in flight are treated as ``mode`` says (``PauseMode``)."""

    @abstractmethod
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's ``wake_up(tags)`` (``None``: every tag)."""

    def sleep_mode_problem(self) -> str | None:
        """Why this engine cannot be put to sleep, with the fix (``None``: it can)."""
        if not self._sleep_mode_enabled():
            return (
                f"the {self.description} engine was built without sleep mode: start it with enable_sleep_mode=True "
                "(vLLM's CUDA build; its CPU build has no sleep mode, and refuses the flag)"
            )
        try:
            self._ask_workers(SLEEP_STATE_METHOD)
        except Exception as error:  # noqa: BLE001  # (vLLM's NotImplementedError, an HTTP error, ...: said)
            return self._no_plugin(error)
        return None

    def _no_plugin(self, error: BaseException) -> str:
        return (
            f"the {self.description} engine's workers did not answer {SLEEP_STATE_METHOD!r} ({error}): they did "
            "not load lightning_vllm's vLLM plugin, so what a sleep did to their weights cannot be known. Install "
            "lightning_vllm in the environment vLLM runs in"
        )

    def sleep_state(self) -> SleepState:
        """What the workers' sleeps left.

        Raises:
            EngineConfigError: the workers lack our plugin (a push into the engine asleep would end its engine core,
                vLLM 57853: it is not made blind).
        """
        try:
            reports = self._ask_workers(SLEEP_STATE_METHOD)
        except Exception as error:
            if SLEEP_STATE_METHOD not in str(error):  # (a dead or busy engine says so itself)
                raise
            raise EngineConfigError(f"Cannot push to or sample from it safely: {self._no_plugin(error)}.") from error
        return SleepState.of_workers(reports)


def sleeping_engine(engine: object) -> SleepMode | None:
    """``engine`` as a target that can sleep, ``None`` unless it was built with sleep mode (asked once per connection:
    an engine without it is never asked anything more)."""
    if isinstance(engine, SleepMode) and engine._sleep_mode_enabled():
        return engine
    return None


def require_sleep_mode(engines: Sequence[EngineTarget]) -> None:
    """Refuse, before any byte moves, engines that cannot be put to sleep (the callback's ``sleep_level``).

    Raises:
        EngineConfigError: an engine was built without sleep mode, cannot sleep at all (a Ray actor), or its workers
            lack our plugin; the message says which and the fix.
    """
    problems = [
        engine.sleep_mode_problem()
        if isinstance(engine, SleepMode)
        else f"the {engine.description} engine cannot be put to sleep by this package"
        for engine in engines
    ]
    if found := [problem for problem in problems if problem]:
        raise EngineConfigError("sleep_level is set, but " + "; ".join(found) + ". Or pass sleep_level=None.")


@dataclass(frozen=True)
class FoundAsleep:
    """What a push found before it sent a byte (:func:`wake_for_push`).

    Attributes:
        state: the engine's sleep state then.
        woke_weights: whether the push woke the weights.
        weights_dropped: whether the weights were dropped since the last push that landed: this push sends every
            layer.
    """

    state: SleepState
    woke_weights: bool
    weights_dropped: bool


def _call(engine: SleepMode, fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
    return call_with_timeout(fn, *args, timeout=timeout, what=f"{engine.description} to {what}")


def wake_for_push(engine: SleepMode, timeout: float) -> FoundAsleep:
    """Before a push into an engine that can sleep: wake its weights if they sleep (vLLM's own push would crash the
    engine core, vLLM 57853), and say whether they were dropped since the last push (the push then sends every
    layer). The KV cache stays as it is: the push needs none."""
    state = _call(engine, engine.sleep_state, timeout=timeout, what="say what its sleep left")
    dropped = engine.dropped_since_last_push(state)
    if state.weights_asleep:
        _call(engine, engine.wake_up, ["weights"], timeout=timeout, what="wake its weights for a push")
    if dropped:
        log.info("%s dropped its weights since the last push: this push sends every layer.", engine.description)
    return FoundAsleep(state, state.weights_asleep, dropped)


def after_push(engine: SleepMode, found: FoundAsleep, timeout: float, *, keep_awake: bool, mode: str) -> None:
    """After a push landed: the engine holds this push's weights whatever was dropped before. An engine the push found
    at level 1 goes back to it unless ``keep_awake`` (the callback's ``sleep_level``: rollouts come next); one found
    at level 2 keeps its weights awake and its KV cache asleep until rollouts wake it."""
    engine.dropped_at_last_push = found.state.dropped
    if found.woke_weights and found.state.level == 1 and not keep_awake:
        log.info("%s goes back to sleep at level 1 (the weights to host memory again).", engine.description)
        _call(engine, engine.sleep, 1, mode, timeout=timeout, what="go back to sleep at level 1")


def wake_for_rollouts(engine: SleepMode, timeout: float) -> None:
    """Before rollouts from an engine that can sleep: wake whatever sleeps.

    Raises:
        WeightsDroppedError: its weights were dropped and no push landed since (it would serve garbage).
    """
    state = _call(engine, engine.sleep_state, timeout=timeout, what="say what its sleep left")
    if engine.dropped_since_last_push(state):
        raise WeightsDroppedError(
            f"{engine.description} dropped its weights (sleep(level=2) or a discard) and no push has landed since: "
            "it would sample from whatever its memory now holds. Push the weights first (a push after a level-2 "
            "sleep sends every layer), or sleep at level 1."
        )
    if state.asleep:
        _call(engine, engine.wake_up, None, timeout=timeout, what="wake up for rollouts")


def put_to_sleep(engine: SleepMode, level: SleepLevel, mode: str, timeout: float) -> None:
    """Put an engine to sleep at ``level`` (the callback, before backward). An engine whose weights already sleep is
    left; one whose KV cache alone sleeps (weights woken for a push, no rollouts since) is woken first, because vLLM
    sleeps only a fully awake engine."""
    state = _call(engine, engine.sleep_state, timeout=timeout, what="say what its sleep left")
    if state.weights_asleep:
        return
    if state.asleep:
        _call(engine, engine.wake_up, None, timeout=timeout, what="wake up before sleeping again")
    _call(engine, engine.sleep, level, mode, timeout=timeout, what=f"sleep at level {level}")


def sleep_engines(engines: Sequence[EngineTarget], level: SleepLevel, mode: str, timeout: float) -> None:
    """:func:`put_to_sleep` every engine built with sleep mode (the fronts: before training's turn)."""
    for engine in engines:
        if (sleeps := sleeping_engine(engine)) is not None:
            put_to_sleep(sleeps, level, mode, timeout)


def wake_engines(engines: Sequence[EngineTarget], timeout: float) -> None:
    """:func:`wake_for_rollouts` every engine built with sleep mode (the fronts: before rollouts' turn).

    Raises:
        WeightsDroppedError: an engine's weights were dropped and no push landed since.
    """
    for engine in engines:
        if (sleeps := sleeping_engine(engine)) is not None:
            wake_for_rollouts(sleeps, timeout)


def host_copy_problem(weight_bytes: int, description: str, available_bytes: int | None = None) -> str | None:
    """What a level-1 sleep of an engine in this process costs in host memory, if the host cannot hold it.

    Level 1 copies the engine's weights (``weight_bytes``, every worker's share on this host) into pinned host memory;
    where that does not fit, the copy fails or the system swaps (vime 190: Ray ran out of memory at 841 of 882 GB).
    ``available_bytes`` defaults to what the host has available now (``psutil``, a dependency of vLLM's).

    Example::

        >>> print(host_copy_problem(8 << 30, "in-process vllm.LLM", available_bytes=6 << 30))
        sleep_level=1 copies the in-process vllm.LLM engine's weights (8.0 GiB) to host memory, which has 6.0 GiB \
available: pass sleep_level=2 (the weights are dropped, and the next push sends every layer), or free host memory
        >>> host_copy_problem(8 << 30, "in-process vllm.LLM", available_bytes=64 << 30) is None
        True
    """
    if available_bytes is None:
        import psutil

        available_bytes = int(psutil.virtual_memory().available)
    if weight_bytes <= available_bytes:
        return None
    return (
        f"sleep_level=1 copies the {description} engine's weights ({weight_bytes / 2**30:.1f} GiB) to host memory, "
        f"which has {available_bytes / 2**30:.1f} GiB available: pass sleep_level=2 (the weights are dropped, and "
        "the next push sends every layer), or free host memory"
    )
