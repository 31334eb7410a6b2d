"""Pushes that do not stop training: a snapshot at the push point, the transfer on a thread.

At a push point the caller's thread (the training loop) checks the push as a blocking
push would, copies what it sends into memory kept between pushes
(``weights/snapshot.py``), and returns; a thread of its own sends the copy and commits
it as the next version once the engine has loaded it. Weights on a GPU are copied on that
GPU when it has room: the push point only queues the copies (the training stream, not the
host, waits for them before its next step), and the push's thread waits for them before
it sends. Without room the copy goes to pinned host memory, which the push point waits
for, and the push copies it back (warned about once). At most one push is in flight: a
push point that finds one still running waits for it or is skipped (``when_busy``), and
a skipped push point's weights go with the next push, which sends the weights of its
own time. Errors of a push are raised by the next :meth:`BackgroundPusher.collect`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.engines.base import ChecksBackgroundPushes
from lightning_vllm.errors import EngineConfigError, WeightSyncTimeoutError
from lightning_vllm.options import WhenBusy, check_choice
from lightning_vllm.weights.snapshot import SnapshotMemory

if TYPE_CHECKING:
    from lightning_vllm.core.push import SyncStats
    from lightning_vllm.core.weight_sync import WeightSync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """What :meth:`BackgroundPusher.submit` did at one push point."""

    started: bool  # a push went on its way (False: the push point was skipped)
    stall_seconds: float  # how long the caller's thread was held: waiting, checking, copying (or queuing copies)
    version: int | None = None  # the version the push commits if it lands
    waited_for: SyncStats | None = None  # the previous push, if this push point waited for it to land


class BackgroundPusher:
    """Sends an updater's pushes on a background thread, one at a time, from snapshots.

    Args:
        updater: the updater whose engines receive the pushes (and whose version moves).
        when_busy: ``"skip"`` or ``"wait"`` (see :data:`WhenBusy`).

    Example::

        >>> pusher = BackgroundPusher(WeightSync(engine=llm))  # doctest: +SKIP
        >>> pusher.submit(model)  # returns once the copy is taken (on a GPU: queued)  # doctest: +SKIP
        Submitted(started=True, stall_seconds=0.04, version=1, waited_for=None)
        >>> pusher.wait(timeout=60); pusher.collect()  # doctest: +SKIP
        SyncStats(weight_version=1, seconds=0.41, num_bytes=209715200)
    """

    def __init__(self, updater: WeightSync, when_busy: WhenBusy = "skip") -> None:
        check_choice("when_busy", when_busy, ("skip", "wait"))
        self.updater = updater
        self.when_busy: WhenBusy = when_busy
        self.memory = SnapshotMemory()
        self._push: BackgroundCall[SyncStats] | None = None

    def check_engines(self) -> None:
        """Check that every engine may be pushed to from a thread other than the one generating.

        Raises:
            EngineConfigError: an engine may not (says which and why).
        """
        for engine in self.updater.engines:
            problem = engine.background_push_problem() if isinstance(engine, ChecksBackgroundPushes) else None
            if problem is not None:
                raise EngineConfigError(
                    f"Background pushes (blocking=False) cannot drive the {engine.description} engine: {problem}. "
                    "Let vLLM run its engine core in a process of its own (the default), or push with blocking=True."
                )

    def in_flight(self) -> bool:
        """Whether a push is on its way (one that ended counts until :meth:`collect` reads it)."""
        return self._push is not None

    def submit(
        self, weights: Any, worker_ids: int | torch.device | Sequence[int | torch.device] | None = None
    ) -> Submitted:
        """Start pushing ``weights`` in the background, or skip (see ``when_busy``).

        Call :meth:`collect` first: a push that ended and was not collected counts as in flight.

        Raises:
            WeightsMismatchError, EngineConfigError, ValueError: as ``push_weights``, before any byte moves.
            WeightSyncError: ``when_busy="wait"`` and the push waited for failed (nothing new was started).
            WeightSyncTimeoutError: ``when_busy="wait"`` and the push in flight outlived ``timeout_seconds``.
        """
        start = time.perf_counter()
        waited_for = None
        if self._push is not None:
            if self.when_busy == "skip":
                with self.updater.versions.push_point():  # it begins no push: the push point is skipped
                    pass
                log.info(
                    "Push point skipped: %s is still on its way; the next push point sends newer weights "
                    "(skipped so far: %d).",
                    self._push.what,
                    self.updater.versions.skipped,
                )
                return Submitted(False, time.perf_counter() - start)
            self.wait_or_raise("at a push point (when_busy='wait')")  # a push still running stays in flight
            waited, self._push = self._push, None
            waited_for = waited.result(0)
        with self.updater.versions.push_point() as point:  # (skipped if the weights cannot even be copied)
            prepared = self.updater.prepare(weights, worker_ids)
            snapshot = self.memory.take(prepared.payload.weights, prepared.payload.stamps)
            in_flight = point.begin(hand_off=True)  # committed or abandoned by the push's own thread
        push = prepared.with_payload(prepared.payload.with_weights(snapshot))
        self._push = BackgroundCall(self.updater.send, push, in_flight, what=f"weight version {in_flight.version}")
        return Submitted(True, time.perf_counter() - start, in_flight.version, waited_for)

    def collect(self) -> SyncStats | None:
        """The figures of the push that ended since the last call (``None``: none did).

        Raises:
            WeightSyncError: that push failed (the engines kept their previous weights), or
                ``PartialPushError``: it failed on some engines only (see ``WeightSync.send``).
        """
        if self._push is None or not self._push.done():
            return None
        push, self._push = self._push, None
        return push.result(0)

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the push in flight to end; whether none is running."""
        return self._push is None or self._push.wait(timeout)

    def wait_or_raise(self, when: str) -> None:
        """Wait for the push in flight to end, at most the updater's ``timeout_seconds``.

        Raises:
            WeightSyncTimeoutError: it is still running (the engine may be frozen); ``when`` says
                at which point of training.
        """
        if not self.wait(self.updater.options.timeout_seconds):
            assert self._push is not None, "wait() is True when nothing is on its way"
            raise WeightSyncTimeoutError(
                f"{self._push.what.capitalize()} was still on its way to vLLM {when}, after "
                f"{self.updater.options.timeout_seconds:g} s (timeout_seconds): the engine may be frozen. No other "
                "push starts until it ends."
            )

    def close(self) -> None:
        """End the push in flight (waiting at most the updater's ``timeout_seconds``), drop its
        outcome unread, and free the snapshot memory. The updater's groups are left as they are."""
        if self._push is not None and not self._push.wait(self.updater.options.timeout_seconds):
            log.warning(
                "%s was still on its way after %g s; closing the groups ends it.",
                self._push.what.capitalize(),
                self.updater.options.timeout_seconds,
            )
        self._push = None
        self.memory.release()
