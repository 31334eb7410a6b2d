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

So ``trainer = max(committed, in_flight) + backlog + missed``. Every rank of a trainer
holds one :class:`WeightVersions`; the ranks that do not push copy global rank 0's at
each push point (:meth:`WeightVersions.as_ints`, :meth:`WeightVersions.adopt`).
"""

from __future__ import annotations

import threading


class WeightVersions:
    """The trainer's weight versions. Thread-safe: a background push commits from its own thread.

    Example::

        >>> versions = WeightVersions()
        >>> version = versions.begin()          # a push point starts a push
        >>> versions.skip()                     # the next push point is skipped meanwhile
        >>> versions.trainer
        2
        >>> versions.commit(version)            # the push lands: version 1 is one push point behind
        >>> versions.committed, versions.trainer, versions.staleness(oldest=1)
        (1, 2, 1)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed = 0
        self._in_flight: int | None = None
        self._backlog = 0
        self._missed = 0

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
    def trainer(self) -> int:
        """The version the engines would serve had every push point's weights landed."""
        with self._lock:
            return max(self._committed, self._in_flight or 0) + self._backlog + self._missed

    def staleness(self, oldest: int) -> int:
        """How many push points a rollout of version ``oldest`` lags the trainer."""
        return self.trainer - oldest

    def begin(self) -> int:
        """A push of the trainer's current weights starts: the version it will commit.

        Raises:
            RuntimeError: another push is on its way (one at a time).
        """
        with self._lock:
            if self._in_flight is not None:
                raise RuntimeError(f"Weight version {self._in_flight} is still on its way; one push at a time.")
            self._in_flight = self._committed + 1
            self._backlog, self._missed = self._backlog + self._missed, 0
            return self._in_flight

    def commit(self, version: int) -> None:
        """The push of ``version`` landed (in at least one engine)."""
        with self._lock:
            self._committed = max(self._committed, version)
            if self._in_flight == version:
                self._in_flight, self._backlog = None, 0

    def abandon(self, version: int) -> None:
        """The push of ``version`` landed nowhere: its push point is missed, as are those before it."""
        with self._lock:
            if self._in_flight == version:
                self._in_flight = None
                self._missed += self._backlog + 1
                self._backlog = 0

    def skip(self) -> None:
        """A push point sent nothing (a push was still on its way)."""
        with self._lock:
            self._missed += 1

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

    def as_ints(self) -> list[int]:
        """``[committed, in_flight or -1, backlog, missed]``: what another rank needs to :meth:`adopt`."""
        with self._lock:
            in_flight = -1 if self._in_flight is None else self._in_flight
            return [self._committed, in_flight, self._backlog, self._missed]

    def adopt(self, values: list[int]) -> None:
        """Take another rank's versions, as :meth:`as_ints` gave them."""
        committed, in_flight, backlog, missed = values
        with self._lock:
            self._committed, self._backlog, self._missed = committed, backlog, missed
            self._in_flight = None if in_flight < 0 else in_flight
