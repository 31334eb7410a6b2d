"""A replay that fingerprints what it writes: the check after every push without a second read of the weights.

The check holds each layer's fingerprint in the engine against the trainer's (``weights/layer_sums.py``). Taken
from the live weights after the commit, it reads every weight again: on an 8B model in bf16 that read cost more than
the copy that loaded them (docs/runs.md, run 29). Here the replay's copies are made by one Triton kernel that sums
the values as it stores them (``weights/gpu_sums.SummedCopies``), into one row per parameter it writes (per routed
expert of a fused expert tensor): one pass writes and sums.

Sums of what was written are the live fingerprint only where the copies write each element of the parameter exactly
once and nothing else writes it. So a parameter's sums are reported (:meth:`SummedReplay.written_sums`) only when
this replay's copies and fills **tile** it: every region lies inside the parameter, no two regions of the whole
replay overlap, and their sizes add up to the parameter's. A copy made to write one row off leaves a row unwritten
and spills into the next, and its parameter is read live after the commit as before, where the values out of place
show. A replay whose copies cannot be made this way (a copy that converts, a tensor not contiguous) is not built:
the worker runs the plain replay, and the check reads the live weights.

What this does not see: a write into a parameter after the replay, by anything other than a load. Nothing of
vLLM's runs between a ``lightning_ipc`` replay and the next generation (``worker.loads_as_held``); a parameter
changed between pushes shows at the next push that does not send it again, and a push that sends it writes it whole.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from lightning_vllm.backends.lightning_ipc.recorded_loads import Replay
from lightning_vllm.weights.gpu_sums import SummedCopies
from lightning_vllm.weights.held_sums import LayerRows, WrittenSums, parameter_rows


@dataclass(frozen=True)
class _Region:
    start: int  # addresses, in bytes: [start, end)
    end: int
    destination: torch.Tensor
    source: torch.Tensor | float | int | bool  # a tensor for a copy, a value for a fill


@dataclass
class _Parameter:
    name: str
    start: int
    end: int
    rows: int  # routed experts held as rows, each summed apart; 0: summed whole
    written: int = 0  # bytes of it the replay's regions write
    spoiled: bool = False  # a region writes part of it and part of something else


class SummedReplay(Replay):
    """``replay``'s calls, run as copies that sum what they write (see the module docstring).

    Args:
        replay: the plain replay (its ``calls``: copies, batched copies and fills).
        parameters: the model's parameters, ``{name: (parameter, rows)}`` (``held_sums.parameter_rows``).

    Raises:
        ValueError: these copies cannot be made so (the worker then runs ``replay``).
    """

    def __init__(self, replay: Replay, parameters: Mapping[str, tuple[torch.Tensor, int]]) -> None:
        self.calls = replay.calls
        regions = _regions(replay)
        regions.sort(key=lambda region: region.start)
        if any(first.end > second.start for first, second in zip(regions, regions[1:])):
            raise ValueError("two of the replay's writes overlap: their order matters, and sums of them are not held")
        held = sorted(
            (
                _Parameter(name, p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), rows)
                for name, (p, rows) in parameters.items()
                if p.is_contiguous() and p.numel()
            ),
            key=lambda parameter: parameter.start,
        )
        starts = [parameter.start for parameter in held]
        self._owners: dict[tuple[str, int], int] = {}  # (parameter, row) -> row of the sums; 0 sums the rest
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        fills: list[tuple[int, torch.Tensor, float | int | bool]] = []  # (owner, destination, value)
        for region in regions:
            parameter = _holding(held, starts, region)
            for owner, destination, source in self._pieces(region, parameter):
                if isinstance(source, torch.Tensor):
                    copies.append((destination, source, owner))
                else:
                    fills.append((owner, destination, source))
        self._fills = [(destination, value) for _, destination, value in fills]
        self._fill_sums = _fill_sums(fills, len(self._owners) + 1)
        self._copies = SummedCopies(copies, len(self._owners) + 1) if copies else None
        self._whole = {
            parameter.name: parameter
            for parameter in held
            if not parameter.spoiled and parameter.written == parameter.end - parameter.start
        }
        self._sums: torch.Tensor | None = None

    def _pieces(
        self, region: _Region, parameter: _Parameter | None
    ) -> list[tuple[int, torch.Tensor, torch.Tensor | float | int | bool]]:
        """``region`` as ``(owner, destination, source)`` pieces: cut where a routed expert's row of ``parameter``
        ends, each summed into its parameter's (row's) owner."""
        if parameter is None:
            return [(0, region.destination, region.source)]
        parameter.written += region.end - region.start
        size = region.destination.element_size()
        row_bytes = (parameter.end - parameter.start) // parameter.rows if parameter.rows else None
        pieces: list[tuple[int, torch.Tensor, torch.Tensor | float | int | bool]] = []
        at = region.start
        while at < region.end:
            row = (at - parameter.start) // row_bytes if row_bytes else 0
            end = min(region.end, parameter.start + (row + 1) * row_bytes) if row_bytes else region.end
            first, last = (at - region.start) // size, (end - region.start) // size
            destination = region.destination.view(-1)[first:last]
            source = region.source.view(-1)[first:last] if isinstance(region.source, torch.Tensor) else region.source
            owner = self._owners.setdefault((parameter.name, row), len(self._owners) + 1)
            pieces.append((owner, destination, source))
            at = end
        return pieces

    def run(self) -> None:
        """Make the copies, summing what they write, then the fills (no two writes overlap: the order is free)."""
        sums = self._copies.run() if self._copies is not None else None
        for destination, value in self._fills:
            destination.fill_(value)
        if self._fill_sums is not None:
            sums = self._fill_sums if sums is None else sums + self._fill_sums
        self._sums = sums

    @property
    def sums(self) -> torch.Tensor | None:
        """The last :meth:`run`'s sums, ``[rows, 3]`` (:meth:`written_rows` says whose), or ``None`` before a run."""
        return self._sums

    def written_rows(self) -> dict[str, list[int]]:
        """Each parameter a run writes whole, with its rows in :attr:`sums`: one per routed expert where it holds
        experts as rows, else one."""
        return {
            name: [self._owners[(name, row)] for row in range(parameter.rows or 1)]
            for name, parameter in self._whole.items()
        }

    def written_sums(self) -> WrittenSums:
        """The sums of each parameter the last :meth:`run` wrote whole, one per routed expert where it holds
        experts as rows (``held_sums.WrittenSums``); empty before a run."""
        if self._sums is None:
            return {}
        rows = self._sums.unbind(0)
        return {name: [rows[row] for row in written] for name, written in self.written_rows().items()}


def _regions(replay: Replay) -> list[_Region]:
    """Every write of ``replay``, with its address range; ``ValueError`` for one that is not contiguous."""
    regions: list[_Region] = []
    for kind, destination, source in replay.calls:
        pairs = zip(destination, source) if kind == "batch" else [(destination, source)]
        for one, other in pairs:
            if not one.is_contiguous() or (isinstance(other, torch.Tensor) and not other.is_contiguous()):
                raise ValueError("a write of the replay is not contiguous")
            start = one.data_ptr()
            regions.append(_Region(start, start + one.numel() * one.element_size(), one, other))
    return [region for region in regions if region.end > region.start]


def _holding(held: list[_Parameter], starts: list[int], region: _Region) -> _Parameter | None:
    """The parameter holding all of ``region``, if one does; a parameter it holds part of is spoiled."""
    position = bisect.bisect_right(starts, region.start) - 1
    before = held[position] if position >= 0 else None
    if before is not None and region.start < before.end:
        if region.end <= before.end:
            return before
        before.spoiled = True
    for parameter in held[position + 1 :]:  # (those starting inside the region)
        if parameter.start >= region.end:
            break
        parameter.spoiled = True
    return None


def _fill_sums(fills: list[tuple[int, torch.Tensor, float | int | bool]], owners: int) -> torch.Tensor | None:
    """The sums the fills add to their owners' rows: each fills its elements with one value, as its destination's
    dtype holds it (``None`` without fills)."""
    if not fills:
        return None
    sums = [[0, 0, 0] for _ in range(owners)]
    for owner, destination, value in fills:
        one = torch.tensor(value, dtype=destination.dtype).float()
        bits = int(one.view(torch.int32))
        square = int((one * one).view(torch.int32))
        not_finite = int((square & 0x7F800000) == 0x7F800000)
        for position, each in enumerate((bits, square, not_finite)):
            sums[owner][position] += each * destination.numel()
    return torch.tensor(sums, dtype=torch.int64, device=fills[0][1].device)


class LastReplaySums:
    """A worker engine's side of ``held_sums.SumsWhatItWrites``: its replays made summing (:meth:`summed`, given to
    ``RecordedLoads``), and the last load's sums, while no other load has come since (:meth:`loaded`).

    Args:
        model: the model the engine loads into, now (vLLM may point the engine at a draft model).
    """

    def __init__(self, model: Callable[[], torch.nn.Module]) -> None:
        self._model = model
        self._parameters: tuple[torch.nn.Module, dict[str, tuple[torch.Tensor, int]]] | None = None
        self._last: Replay | None = None
        self._rows: tuple[Replay, LayerRows | None] | None = None  # the last replay's layout of its layers' rows

    def summed(self, replay: Replay) -> Replay:
        """``replay`` made into a :class:`SummedReplay`, or as it is where its copies cannot sum."""
        model = self._model()
        if self._parameters is None or self._parameters[0] is not model:
            self._parameters = (model, parameter_rows(model))  # (a model's parameters stay where they are)
        try:
            return SummedReplay(replay, self._parameters[1])
        except ValueError:
            return replay

    def loaded(self, replay: Replay | None) -> None:
        """A load ran: ``replay``, or the loaders (``None``)."""
        self._last = replay

    def written_sums(self) -> WrittenSums | None:
        """The sums the last load took as it wrote, if it was a replay that summed."""
        return self._last.written_sums() if self._last is not None else None

    def layer_rows(self) -> torch.Tensor | None:
        """The model's fingerprints per layer after the last load (``held_sums.LayerRows.rows``: on the device, nothing
        synced), if that load was a replay that summed and the model's report is nothing but such rows; else
        ``None``. Laid out once per replay: a push that replays the last one's copies reuses it."""
        last = self._last
        if not isinstance(last, SummedReplay) or last.sums is None:
            return None
        if self._rows is None or self._rows[0] is not last:
            self._rows = (last, LayerRows.for_model(self._model(), last.written_rows()))
        rows = self._rows[1]
        return rows.rows(last.sums) if rows is not None else None
