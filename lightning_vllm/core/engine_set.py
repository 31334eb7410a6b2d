"""The engines one ``WeightSync`` pushes to, by index, and the transfer group formed with each.

An engine's *index* is its position in the ``engine=`` list; TorchRL's front end calls
it a worker id (``push_weights(worker_ids=...)``, ``all_worker_ids()``), which is the
only meaning "worker id" has in this package's API. A vLLM *worker* is one of an
engine's processes (tensor-, pipeline-, data-parallel ranks), which join its group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_vllm.core.connection import EngineConnection
from lightning_vllm.engines import EngineTarget
from lightning_vllm.engines.failures import engine_death
from lightning_vllm.errors import EngineConfigError, WeightsMismatchError, WeightSyncError

EngineSelection = int | torch.device | Sequence[int | torch.device] | None
"""Engines named by index or by device type (all of that type), or ``None`` for all."""


class EngineSet:
    """The engine targets of one updater and their connections (one transfer group per engine).

    Args:
        targets: the engines, in index order.
        connect: opens the connection of the engine of an index (the updater's settings and
            metadata); called when a push needs an engine not connected yet.
    """

    def __init__(self, targets: list[EngineTarget], connect: Callable[[int], EngineConnection]) -> None:
        self.targets = targets
        self.connections: dict[int, EngineConnection] = {}
        self._connect = connect

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

    def connected(self, indices: Sequence[int]) -> tuple[dict[int, EngineConnection], dict[int, BaseException]]:
        """The connection of each engine, joining the groups not formed yet, and the engines that
        cannot be reached now (their errors): a push still goes to the others.

        Raises:
            EngineConfigError, WeightsMismatchError: an engine is misconfigured, which no retry fixes.
            WeightSyncError: no engine can be reached (the first one's error).
        """
        connections: dict[int, EngineConnection] = {}
        unreachable: dict[int, BaseException] = {}
        for index in indices:
            try:
                connections[index] = self.connections.get(index) or self.open(index)
            except (EngineConfigError, WeightsMismatchError):
                raise
            except WeightSyncError as error:
                unreachable[index] = error
        if not connections:
            raise next(iter(unreachable.values()))
        return connections, unreachable

    def open(self, index: int) -> EngineConnection:
        """Open (again) the connection of the engine at ``index``.

        Raises:
            EngineDeadError: the engine is gone (its error says how to go on).
        """
        try:
            connection = self._connect(index)
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
