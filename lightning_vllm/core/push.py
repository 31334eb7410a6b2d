"""The engines an updater pushes to, and one push to them as an object: prepared (every check done, nothing sent),
then sent and committed, and what it reports.

``WeightSync.prepare`` builds a :class:`Push`: what it carries (its :class:`Payload`), the
engines it goes to, and those it cannot reach now. :meth:`Push.send` sends it to each engine,
whatever happened to the others, and ends the version it was given: committed as soon as one
engine has it (a version never names two sets of weights), abandoned when none has. Nothing
else moves a version during a push.

An engine's *index* is its position in the ``engine=`` list; TorchRL's front end calls
it a worker id (``push_weights(worker_ids=...)``, ``all_worker_ids()``), which is the
only meaning "worker id" has in this package's API. A vLLM *worker* is one of an
engine's processes (tensor-, pipeline-, data-parallel ranks), which join its group.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from lightning_vllm.core.connection import EngineConnection, Pushed, PushTiming
from lightning_vllm.core.versions import InFlight
from lightning_vllm.engines import EngineTarget
from lightning_vllm.engines.failures import engine_death
from lightning_vllm.errors import (
    EngineConfigError,
    LandedWeightsMismatchError,
    PartialPushError,
    PushAborted,
    WeightsMismatchError,
    WeightSyncError,
)
from lightning_vllm.options import UpdaterOptions
from lightning_vllm.weights import ModelMetadata
from lightning_vllm.weights.payload import Payload

EngineSelection = int | torch.device | Sequence[int | torch.device] | None
"""Engines named by index or by device type (all of that type), or ``None`` for all."""


class EngineSet:
    """The engine targets of one updater and their connections (one transfer group per engine).

    Args:
        targets: the engines, in index order.
    """

    def __init__(self, targets: list[EngineTarget]) -> None:
        self.targets = targets
        self.connections: dict[int, EngineConnection] = {}

    def __len__(self) -> int:
        return len(self.targets)

    def indices(self) -> list[int]:
        """Every engine's index."""
        return list(range(len(self.targets)))

    def resolve(self, selection: EngineSelection) -> list[int]:
        """The indices ``selection`` names, sorted (all when ``None``).

        Raises:
            ValueError: an unknown index, or a device type no engine has.
        """
        known = self.indices()
        if selection is None:
            return known
        requested = [selection] if isinstance(selection, (int, torch.device)) else list(selection)
        resolved: list[int] = []
        for worker in requested:
            if isinstance(worker, torch.device):
                resolved += [i for i in known if self.targets[i].device_type() == worker.type]
            elif worker in known:
                resolved.append(worker)
            else:
                raise ValueError(f"Unknown worker id {worker!r}; this updater's engines are {known}.")
        if not resolved:
            raise ValueError(f"worker_ids={selection!r} selects no engine; this updater's engines are {known}.")
        return sorted(set(resolved))

    def connected(
        self, indices: Sequence[int], metadata: ModelMetadata, options: UpdaterOptions
    ) -> tuple[dict[int, EngineConnection], dict[int, BaseException]]:
        """The connection of each engine, joining the groups not formed yet (for ``metadata``, with ``options``),
        and the engines that cannot be reached now (their errors): a push still goes to the others.

        Raises:
            EngineConfigError, WeightsMismatchError: an engine is misconfigured, which no retry fixes.
            WeightSyncError: no engine can be reached (the first one's error).
        """
        connections: dict[int, EngineConnection] = {}
        unreachable: dict[int, BaseException] = {}
        for index in indices:
            try:
                connections[index] = self.connections.get(index) or self.open(index, metadata, options)
            except (EngineConfigError, WeightsMismatchError):
                raise
            except WeightSyncError as error:
                unreachable[index] = error
        if not connections:
            raise next(iter(unreachable.values()))
        return connections, unreachable

    def open(self, index: int, metadata: ModelMetadata, options: UpdaterOptions) -> EngineConnection:
        """Open (again) the connection of the engine at ``index``, for ``metadata``, with ``options``.

        Raises:
            EngineDeadError: the engine is gone (its error says how to go on).
        """
        try:
            connection = EngineConnection.open(self.targets[index], metadata, options, index)
        except Exception as error:
            if dead := engine_death(error, self.targets[index], "before the push could join it"):
                raise dead from error
            raise
        self.connections[index] = connection
        return connection

    def forget(self, index: int) -> None:
        """Drop the connection of ``index`` (a failed push closed it); the next push opens a new one."""
        self.connections.pop(index, None)

    def close(self) -> None:
        """Leave every group and release the engines' side of them; the engines keep serving."""
        while self.connections:
            _, connection = self.connections.popitem()
            connection.close()


@dataclass(frozen=True)
class SyncStats:
    """Figures of one push that landed in at least one engine.

    Attributes:
        weight_version: the version committed.
        seconds: how long the push took, every engine included.
        num_bytes: the bytes sent, every engine included.
        engine_indices: the engines that committed it (their positions in ``engine=``).
        failed_engine_indices: the engines it failed on (they keep their previous weights; see
            :class:`~lightning_vllm.errors.PartialPushError`).
        timing: where the seconds went, summed over the engines that took it (:class:`PushTiming`).
        checked_layers: the check after the push (``verify_pushes``): the layers whose fingerprints were compared,
            of the layers the engines should hold, summed over the engines (``(0, 0)``: not checked).
    """

    weight_version: int
    seconds: float
    num_bytes: int
    engine_indices: tuple[int, ...] = ()
    failed_engine_indices: tuple[int, ...] = ()
    timing: PushTiming = PushTiming()
    checked_layers: tuple[int, int] = (0, 0)

    @property
    def gb_per_second(self) -> float:
        """The bytes sent over the seconds spent moving them (``timing.transfer_seconds``), in GB/s
        (1e9 bytes); 0 when nothing moved."""
        seconds = self.timing.transfer_seconds
        return self.num_bytes / seconds / 1e9 if seconds > 0 and self.num_bytes else 0.0


@dataclass(frozen=True)
class Push:
    """A checked push not sent yet.

    Attributes:
        payload: what it carries.
        connections: the connections of the engines it goes to (connected, checked), by index.
        unreachable: the engines it cannot reach now, with their errors (they count as failed).
    """

    payload: Payload
    connections: dict[int, EngineConnection]
    unreachable: dict[int, BaseException] = field(default_factory=dict)
    engines: EngineSet | None = field(default=None, repr=False, compare=False)

    @property
    def engine_indices(self) -> list[int]:
        """The engines it goes to, in index order."""
        return list(self.connections)

    def with_payload(self, payload: Payload) -> Push:
        """The same push carrying ``payload`` (a background snapshot): the same
        metadata, so the checks made still hold."""
        return replace(self, payload=payload)

    def send(self, in_flight: InFlight) -> Sent:
        """Send this push to each of its engines and end its version, ``in_flight``: committed once any engine has
        it.

        Every engine is tried, whatever happened to the others; an engine that fails keeps its
        previous weights and joins again at the next push. Once committed, each engine's per-layer sums
        are held against what was sent (``verify_pushes``). What went wrong on some engines is in the
        returned :class:`Sent` (``Sent.raise_failures``), for the caller to run its hooks first.

        Raises:
            WeightSyncError: no engine took it; the error of the first engine that failed (the
                version is not committed).
        """
        assert self.engines is not None, "a push is made by WeightSync.prepare"
        start = time.perf_counter()
        committed: dict[int, EngineConnection] = {}
        failures: dict[int, BaseException] = dict(self.unreachable)
        num_bytes, timing = 0, PushTiming()
        indices = self.engine_indices
        try:
            for position, (index, connection) in enumerate(self.connections.items()):
                try:
                    pushed = self._push_one(index, connection, in_flight.version)
                except PushAborted as error:  # another trainer rank stopped: no engine left can get this push
                    failures.update(dict.fromkeys(indices[position:], error))
                    break
                except Exception as error:  # noqa: BLE001  # the other engines still get the push
                    failures[index] = error
                    continue
                num_bytes, timing = num_bytes + pushed.num_bytes, timing + pushed.timing
                committed[index] = connection
        finally:
            if committed:
                in_flight.commit()
            else:
                in_flight.abandon()
        if not committed:
            raise next(iter(failures.values()))
        checked_at = time.perf_counter()
        found = {index: connection.check_result() for index, connection in committed.items()}
        mismatched = {index: result.differing for index, result in found.items() if result.differing}
        timing = replace(timing, check_seconds=time.perf_counter() - checked_at)
        checked_layers = (
            sum(result.covered[0] for result in found.values()),
            sum(result.covered[1] for result in found.values()),
        )
        elapsed = time.perf_counter() - start
        stats = SyncStats(
            in_flight.version, elapsed, num_bytes, tuple(committed), tuple(sorted(failures)), timing, checked_layers
        )
        return Sent(stats, mismatched, failures, self.engines)

    def _push_one(self, index: int, connection: EngineConnection, version: int) -> Pushed:
        """Send the payload to the engine at ``index`` over ``connection``, the one the push was prepared with, and
        commit ``version``. A failed push closed the connection, which is forgotten: the next push opens a new one.

        Raises:
            RuntimeError: that connection was closed since (a push that failed in between: the next push opens
                a new one).
            EngineDeadError: the engine died (it keeps nothing of this push).
        """
        assert self.engines is not None
        if self.engines.connections.get(index) is not connection:
            raise RuntimeError(f"The connection to engine {index!r} closed after this push was prepared; push again.")
        try:
            return connection.push(self.payload, version)
        except BaseException as error:
            self.engines.forget(index)
            if dead := engine_death(error, self.engines.targets[index], "during a push"):
                raise dead from error
            raise


@dataclass(frozen=True)
class Sent:
    """A push that committed, on at least one engine.

    Attributes:
        stats: its figures.
        mismatched: the engines that hold other weights than were sent, with the layers that differ.
        failures: the engines it did not reach, with their errors.
        engines: the engine set it went to (for the errors' words).
    """

    stats: SyncStats
    mismatched: dict[int, list[str]]
    failures: dict[int, BaseException]
    engines: EngineSet = field(repr=False)

    def raise_failures(self) -> None:
        """Raise what went wrong on some engines.

        Raises:
            LandedWeightsMismatchError: the version was committed, but an engine holds other weights
                than were sent (the layers are named; the next push sends every tensor again).
            PartialPushError: some engines took the push and some did not (its ``stats`` and
                ``failures`` say which).
        """
        if self.mismatched:
            raise _mismatch_error(self.engines, self.stats, self.mismatched)
        if self.failures:
            raise _partial_push_error(self.engines, self.stats, self.failures)


def _mismatch_error(engines: EngineSet, stats: SyncStats, layers: dict[int, list[str]]) -> LandedWeightsMismatchError:
    """The error of a push that committed in engines that now hold other weights than were sent."""
    named = "; ".join(
        f"engine {index} ({engines.targets[index].description}): {len(found)} layer(s), "
        + ", ".join(found[:8])
        + (" ..." if len(found) > 8 else "")
        for index, found in sorted(layers.items())
    )
    return LandedWeightsMismatchError(
        f"Weight version {stats.weight_version} was committed, but what the engine holds now differs from what "
        f"was sent (per-layer fingerprints: exact sums of the values' and their squares' bit patterns): {named}. "
        "The engine serves those weights; the next push sends every tensor again. If the layers differ after "
        "every push, the model's vLLM loader changes weights as it loads them (its sums cannot match): pass "
        "verify_pushes=False.",
        stats,
        layers,
    )


def _partial_push_error(engines: EngineSet, stats: SyncStats, failures: dict[int, BaseException]) -> PartialPushError:
    """The error of a push that reached the engines of ``stats`` and failed on those of ``failures``."""
    named = "; ".join(
        f"engine {index} ({engines.targets[index].description}): {type(error).__name__}: {error}"
        for index, error in sorted(failures.items())
    )
    error = PartialPushError(
        f"Weight version {stats.weight_version} reached engine(s) {list(stats.engine_indices)} but failed on "
        f"{named}. Those engines keep their previous weights, and their rollouts say so; the next push joins "
        "them again.",
        stats,
        failures,
    )
    error.__cause__ = next(iter(failures.values()))
    return error
