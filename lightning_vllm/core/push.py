"""One push as an object: prepared (every check done, nothing sent), then sent and committed.

``WeightSync.prepare`` builds a :class:`Push`: what it carries (its :class:`Payload`), the
engines it goes to, and those it cannot reach now. :meth:`Push.send` sends it to each engine,
whatever happened to the others, and ends the version it was given: committed as soon as one
engine has it (a version never names two sets of weights), abandoned when none has. Nothing
else moves a version during a push.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_vllm.core.engine_set import EngineSet
from lightning_vllm.core.stats import SyncStats
from lightning_vllm.core.versions import InFlight
from lightning_vllm.weights.payload import Payload


@dataclass(frozen=True)
class Push:
    """A checked push not sent yet.

    Attributes:
        payload: what it carries.
        engine_indices: the engines it goes to (connected, checked).
        unreachable: the engines it cannot reach now, with their errors (they count as failed).
    """

    payload: Payload
    engine_indices: list[int]
    unreachable: dict[int, BaseException] = field(default_factory=dict)
    engines: EngineSet | None = field(default=None, repr=False, compare=False)
    landed: Callable[[SyncStats], Any] = field(default=lambda stats: None, repr=False, compare=False)

    def with_payload(self, payload: Payload) -> Push:
        """The same push carrying ``payload`` (a background snapshot): the same
        metadata, so the checks made still hold."""
        return replace(self, payload=payload)

    def send(self, version: InFlight) -> SyncStats:
        """Send this push to each of its engines and end ``version``: committed once any engine has it.

        Every engine is tried, whatever happened to the others; an engine that fails keeps its
        previous weights and joins again at the next push. ``landed`` (the post hooks) runs once the
        version is committed.

        Once committed, each engine's per-layer sums are held against what was sent (``verify_pushes``).

        Raises:
            LandedWeightsMismatchError: the version was committed, but an engine holds other weights
                than were sent (the layers are named; the next push sends every tensor again).
            PartialPushError: some engines took the push and some did not (its ``stats`` and
                ``failures`` say which).
            WeightSyncError: no engine took it; the error of the first engine that failed (the
                version is not committed).
        """
        assert self.engines is not None, "a push is made by WeightSync.prepare"
        start = time.perf_counter()
        committed: list[int] = []
        try:
            committed, failures, num_bytes, timing = self.engines.push_each(
                self.payload, self.engine_indices, version.version
            )
        finally:
            if committed:
                version.commit()
            else:
                version.abandon()
        failures = {**self.unreachable, **failures}
        if not committed:
            raise next(iter(failures.values()))
        checked_at = time.perf_counter()
        mismatched = self.engines.differing_layers(committed)
        timing = replace(timing, check_seconds=time.perf_counter() - checked_at)
        elapsed = time.perf_counter() - start
        stats = SyncStats(version.version, elapsed, num_bytes, tuple(committed), tuple(sorted(failures)), timing)
        if mismatched:  # committed (the engines hold this version), but not as sent: the post hooks do not run
            raise self.engines.mismatch_error(stats, mismatched)
        self.landed(stats)
        if failures:
            raise self.engines.partial_push_error(stats, failures)
        return stats
