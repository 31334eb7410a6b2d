"""The one owner of a trainer's weight versions: committed, in flight and missed, as ints.

A *version* names one set of weights an engine loaded: the updater commits version
``v + 1`` in an engine when a push lands there. The trainer's own position is counted
in *push points* (``VLLMWeightSync``'s schedule): a push point whose weights never
reach the engines (skipped while a background push is on its way, or failed) still
moves the trainer on by one. Staleness is the trainer's position minus the version
that produced a rollout:

* ``committed``: the highest version any engine committed;
* ``in_flight``: the version a push on its way will commit, ``None`` when none is;
* ``missed``: push points since the newest push started whose weights no engine will get;
* ``backlog``: push points missed before the push in flight started (they count until it
  lands, and are missed for good if it fails).

So ``trainer = max(committed, in_flight) + backlog + missed``.

A push point is *skipped* when it began no push and raised nothing (a push was still on its way): the one count of
them is here (:attr:`WeightVersions.skipped`, and :attr:`WeightVersions.unsent` since the last push began), logged
as ``vllm/sync_skipped``; a push point that failed is missed, not skipped.

A push moves versions only through its push point's handle (:meth:`WeightVersions.push_point`):
it begins an :class:`InFlight` version, which commits or is abandoned; a push point that
began nothing is skipped when its handle closes, and a push that neither committed nor was
handed to another thread is abandoned. Three moves come from outside a push, each a method here:
:meth:`WeightVersions.follow` (an engine already serves a later version), :meth:`WeightVersions.count_one`
(TorchRL's ``increment_version``) and :meth:`WeightVersions.set_committed` (``weight_version = ...``).
Every rank of a trainer holds one
:class:`WeightVersions`; the ranks that do not push adopt global rank 0's
(:meth:`PushPointVersions.adopt`, by name: a :class:`VersionState`).
"""

from __future__ import annotations

import threading
from dataclasses import astuple, dataclass
from types import TracebackType


@dataclass(frozen=True)
class VersionState:
    """What another rank needs to take this rank's versions (see the module docstring)."""

    committed: int
    in_flight: int | None = None
    backlog: int = 0
    missed: int = 0
    skipped: int = 0
    unsent: int = 0

    def to_ints(self) -> list[int]:
        """The state as ints, to broadcast between ranks (``in_flight`` ``None`` is ``-1``)."""
        return [-1 if value is None else value for value in astuple(self)]

    @classmethod
    def from_ints(cls, values: list[int]) -> VersionState:
        """The state :meth:`to_ints` gave."""
        committed, in_flight, *counts = values
        return cls(committed, None if in_flight < 0 else in_flight, *counts)


class WeightVersions:
    """The trainer's weight versions. Thread-safe: a background push commits from its own thread.

    Example::

        >>> versions = WeightVersions()
        >>> with versions.push_point() as point:  # a push point starts a push on a thread of its own
        ...     push = point.begin(hand_off=True)
        >>> with versions.push_point():           # the next push point is skipped meanwhile
        ...     pass
        >>> versions.trainer
        2
        >>> push.commit()                         # the push lands: version 1 is one push point behind
        >>> versions.committed, versions.trainer, versions.staleness(oldest=1)
        (1, 2, 1)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed = 0
        self._in_flight: int | None = None
        self._backlog = 0
        self._missed = 0
        self._skipped = 0
        self._unsent = 0
        self._oldest_sampled: int | None = None  # the oldest version rollouts used since take_staleness

    def __getstate__(self) -> dict[str, object]:  # spawned ranks get a copy: the lock is not copied
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def committed(self) -> int:
        """The highest version any engine committed (0 before the first push)."""
        return self._committed

    @property
    def in_flight(self) -> int | None:
        """The version the push on its way will commit, ``None`` when no push is on its way."""
        return self._in_flight

    @property
    def missed(self) -> int:
        """Push points whose weights no engine got and none will (failed or skipped)."""
        with self._lock:
            return self._backlog + self._missed

    @property
    def skipped(self) -> int:
        """Push points skipped so far: each began no push and raised nothing (a push was still on its way)."""
        return self._skipped

    @property
    def unsent(self) -> int:
        """Push points skipped since the last push began: their weights reach an engine only with a later push."""
        return self._unsent

    @property
    def trainer(self) -> int:
        """The version the engines would serve had every push point's weights landed."""
        with self._lock:
            return max(self._committed, self._in_flight or 0) + self._backlog + self._missed

    def staleness(self, oldest: int) -> int:
        """How many push points a rollout of version ``oldest`` lags the trainer."""
        return self.trainer - oldest

    def sampled(self, oldest: int) -> None:
        """Rollouts of versions ``oldest`` and later are about to be used (for :meth:`take_staleness`)."""
        with self._lock:
            if self._oldest_sampled is None or oldest < self._oldest_sampled:
                self._oldest_sampled = oldest

    def take_staleness(self) -> int | None:
        """How many push points the oldest rollout used since the last call lags the trainer (``None``: none was).

        Example::

            >>> versions = WeightVersions()
            >>> versions.take_staleness() is None
            True
            >>> versions.set_committed(5); versions.sampled(3); versions.sampled(4)
            >>> versions.take_staleness(), versions.take_staleness()
            (2, None)
        """
        with self._lock:
            oldest, self._oldest_sampled = self._oldest_sampled, None
        return None if oldest is None else self.staleness(oldest)

    @property
    def next(self) -> int:
        """The version the next push will commit."""
        return self._committed + 1

    def push_point(self) -> PushPointVersions:
        """The handle of one push point: ``with versions.push_point() as point:``."""
        return PushPointVersions(self)

    def _begin(self) -> int:
        """A push of the trainer's current weights starts: the version it will commit.

        Raises:
            RuntimeError: another push is on its way (one at a time).
        """
        with self._lock:
            if self._in_flight is not None:
                raise RuntimeError(f"Weight version {self._in_flight} is still on its way; one push at a time.")
            self._in_flight = self._committed + 1
            self._backlog, self._missed, self._unsent = self._backlog + self._missed, 0, 0
            return self._in_flight

    def _commit(self, version: int) -> None:
        """The push of ``version`` landed (in at least one engine)."""
        with self._lock:
            self._committed = max(self._committed, version)
            if self._in_flight == version:
                self._in_flight, self._backlog = None, 0

    def _abandon(self, version: int) -> None:
        """The push of ``version`` landed nowhere: its push point is missed, as are those before it."""
        with self._lock:
            if self._in_flight == version:
                self._in_flight = None
                self._missed += self._backlog + 1
                self._backlog = 0

    def _skip(self, failed: bool) -> None:
        """A push point began no push: it failed first, or was skipped (a push was still on its way)."""
        with self._lock:
            self._missed += 1
            if not failed:
                self._skipped += 1
                self._unsent += 1

    def count_one(self) -> None:
        """One more committed version without a push (TorchRL's ``increment_version``)."""
        with self._lock:
            self._committed += 1

    def follow(self, version: int) -> None:
        """An engine already serves ``version`` (another trainer, an earlier run): count on from it."""
        with self._lock:
            self._committed = max(self._committed, version)

    def set_committed(self, version: int) -> None:
        """Set the committed version (``VLLMUpdater.weight_version = ...``).

        Raises:
            ValueError: a negative version.
        """
        if version < 0:
            raise ValueError(f"Invalid value for weight_version={version}. Must be >= 0.")
        with self._lock:
            self._committed = int(version)

    def state(self) -> VersionState:
        """What another rank needs to :meth:`PushPointVersions.adopt` these versions."""
        with self._lock:
            return VersionState(
                self._committed, self._in_flight, self._backlog, self._missed, self._skipped, self._unsent
            )

    def _adopt(self, state: VersionState) -> None:
        with self._lock:
            self._committed, self._in_flight = state.committed, state.in_flight
            self._backlog, self._missed = state.backlog, state.missed
            self._skipped, self._unsent = state.skipped, state.unsent


class InFlight:
    """The version a push on its way will commit: it ends exactly once, committed or abandoned."""

    def __init__(self, versions: WeightVersions, version: int) -> None:
        self._versions = versions
        self.version = version
        self.ended = False

    def commit(self) -> None:
        """The push landed (in at least one engine)."""
        if not self.ended:
            self.ended = True
            self._versions._commit(self.version)

    def abandon(self) -> None:
        """The push landed nowhere: its push point is missed, as are those skipped while it was on its way."""
        if not self.ended:
            self.ended = True
            self._versions._abandon(self.version)


class PushPointVersions:
    """One push point's handle on the versions (:meth:`WeightVersions.push_point`).

    On exit: a push point that began no push and adopted nothing is skipped, or failed if it exits with an error
    (its weights reach no engine); a push it began that neither committed nor was handed to another thread is
    abandoned.
    """

    def __init__(self, versions: WeightVersions) -> None:
        self._versions = versions
        self._push: InFlight | None = None
        self._handed_off = False
        self._adopted = False

    def __enter__(self) -> PushPointVersions:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._push is None and not self._adopted:
            self._versions._skip(failed=error is not None)
        elif self._push is not None and not self._handed_off:
            self._push.abandon()  # (a no-op once it committed)

    def begin(self, hand_off: bool = False) -> InFlight:
        """A push of this push point's weights starts: the version it will commit.

        Args:
            hand_off: the push ends on another thread (a background push), which commits or abandons it.

        Raises:
            RuntimeError: another push is on its way (one at a time), or this push point began one already.
        """
        if self._push is not None:
            raise RuntimeError("A push point sends one push.")
        self._push = InFlight(self._versions, self._versions._begin())
        self._handed_off = hand_off
        return self._push

    def adopt(self, state: VersionState) -> None:
        """This rank does not push: it takes the versions of the rank that did (rank 0's)."""
        self._adopted = True
        self._versions._adopt(state)
