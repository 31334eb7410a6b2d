"""A model's load of pushed tensors, recorded once as copies, then replayed without its loaders.

vLLM's ``load_weights`` runs Python per tensor (names mapped onto fused parameters, shards
and offsets computed, shapes checked) before it copies. On an 8B model that Python is most
of a push once the bytes move with one copy (docs/runs.md). What it does to the parameters
is the same at every push of tensors of the same shapes: copy a view of each incoming
tensor into a view of a parameter, and fill padding with a constant. :func:`record_load`
watches one load (a ``TorchDispatchMode`` sees every tensor operation) and keeps exactly
that, per incoming tensor; :meth:`RecordedLoads.bind` resolves the copies against one incoming
tensor, and :class:`Replay` runs bound loads as PyTorch's copies: a ``copy_`` per large tensor, small ones
batched (``torch._foreach_copy_``).

Binding is what makes kept CUDA IPC handles pay (``worker.py``): a trainer's tensor whose
storage stays put between pushes (an optimizer step writes in place) is bound once, and each
later push of it is one batched copy with no Python per tensor.

A load is kept only when everything it did to the parameters and with the incoming tensors
was such a copy, a constant fill or taking a view: a loader that computes (scales,
concatenates, converts into a new tensor) or changes a parameter in place otherwise leaves
no record, and every push of that tensor goes through the loaders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from lightning_vllm.weights.held_sums import WrittenSums


_aten = torch.ops.aten


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


@dataclass(frozen=True)
class _Copy:
    destination: torch.Tensor  # a view of a parameter (it keeps the parameter's storage alive)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the incoming tensor's own storage offset

    def source_view(self, source: torch.Tensor) -> torch.Tensor:
        return source.as_strided(self.size, self.stride, source.storage_offset() + self.offset)


@dataclass(frozen=True)
class _Fill:
    destination: torch.Tensor
    value: Any


@dataclass(frozen=True)
class BoundLoad:
    """One incoming tensor's load, resolved against that tensor: ``(destination, source view)`` copies and
    ``(destination, value)`` fills, in the order the loaders made them."""

    steps: tuple[tuple[torch.Tensor, torch.Tensor | Any, bool], ...]  # (destination, source or value, is_copy)


_BATCHED_BELOW_BYTES = 1 << 20
"""Copies smaller than this go in ``torch._foreach_copy_`` batches (one launch for many norms); larger ones are
a ``copy_`` each, PyTorch's copy kernel, whose speed is the floor a push is measured against, and whose launch
(microseconds) is hidden behind the previous copy on the device."""


def merged_copies(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, source)`` copies, those that continue one another in both memories made one.

    A MoE layer's experts arrive as views of one fused tensor per projection (``weights/checkpoint_layout.py``) and
    land in vLLM's fused expert tensors at the same offsets: in destination order, expert after expert, both sides
    are contiguous runs, and the layer's thousands of copies become one per fused tensor. Only a run of copies into
    one storage is put in order, and only if no two of its destinations overlap.

    Example::

        >>> fused, held = torch.arange(8.0), torch.zeros(8)
        >>> [tuple(d.shape) for d, _ in merged_copies([(held[4:], fused[4:]), (held[:4], fused[:4])])]
        [(8,)]
    """
    merged: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = 0
    for end in range(1, len(copies) + 1):  # each run of copies into one storage, in destination order
        if end < len(copies) and _storage(copies[end][0]) == _storage(copies[start][0]):
            continue
        run = sorted(copies[start:end], key=lambda copy: copy[0].storage_offset())
        if any(_overlap(a[0], b[0]) for a, b in zip(run, run[1:])):
            run = copies[start:end]
        for destination, source in run:
            if merged and _continues(merged[-1], (destination, source)):
                last_destination, last_source = merged[-1]
                numel = last_destination.numel() + destination.numel()
                merged[-1] = (_flat(last_destination, numel), _flat(last_source, numel))
            else:
                merged.append((destination, source))
        start = end
    return merged


def _overlap(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``second`` (at or after ``first`` in the same storage) begins before ``first``'s elements end."""
    end = first.storage_offset() + sum((size - 1) * stride for size, stride in zip(first.shape, first.stride())) + 1
    return _storage(first) == _storage(second) and first.dtype == second.dtype and second.storage_offset() < end


def _continues(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether both tensors of ``second`` start where those of ``first`` end, all four contiguous and alike."""
    for before, after in zip(first, second):
        if not (before.is_contiguous() and after.is_contiguous() and before.dtype == after.dtype):
            return False
        if _storage(before) != _storage(after) or after.storage_offset() != before.storage_offset() + before.numel():
            return False
    return all(destination.numel() == source.numel() for destination, source in (first, second))


def _flat(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    return tensor.as_strided((numel,), (1,), tensor.storage_offset())


class Replay:
    """Bound loads made into the calls that run them, in order: a ``copy_`` per large copy, a ``_foreach_copy_``
    per run of small ones, a ``fill_`` where one was made (a padding fill after the copy it follows). Built once,
    run at every push of the same tensors (``worker.py`` keeps it while the trainer's slots stay put)."""

    def __init__(self, loads: Iterable[BoundLoad]) -> None:
        self.calls: list[tuple[str, Any, Any]] = []  # ("copy" | "batch" | "fill", destination(s), source(s) or value)
        destinations: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # the copies since the last fill, not yet made calls

        def flush() -> None:
            if destinations:
                self.calls.append(("batch", list(destinations), list(sources)))
                destinations.clear()
                sources.clear()

        def add_copies() -> None:
            for destination, source in merged_copies(copies):
                if destination.numel() * destination.element_size() >= _BATCHED_BELOW_BYTES:
                    flush()
                    self.calls.append(("copy", destination, source))
                else:
                    destinations.append(destination)
                    sources.append(source)
            copies.clear()

        for load in loads:
            for destination, source, is_copy in load.steps:
                if is_copy:
                    copies.append((destination, source))
                    continue
                add_copies()
                flush()
                self.calls.append(("fill", destination, source))
        add_copies()
        flush()

    def written_sums(self) -> WrittenSums | None:
        """The sums of what the last run wrote (``summed_replay.SummedReplay``); a plain replay takes none."""
        return None

    def run(self) -> None:
        """Queue every call on the current stream."""
        for kind, destination, source in self.calls:
            if kind == "copy":
                destination.copy_(source)
            elif kind == "batch":
                torch._foreach_copy_(destination, source)
            else:
                destination.fill_(source)


@dataclass
class _TensorRecord:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    steps: list[_Copy | _Fill] = field(default_factory=list)

    def fits(self, tensor: torch.Tensor) -> bool:
        return (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype) == (self.shape, self.stride, self.dtype)


class RecordedLoads:
    """What loading each incoming tensor (by name) did to the model: copies and fills, in order.

    Example::

        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> def load(weights):
        ...     for _, tensor in weights:
        ...         model.weight.data.copy_(tensor)
        >>> loads = RecordedLoads()
        >>> loads.load(load, [("w", torch.ones(2, 2))], model.parameters) is None  # through the loaders, recorded
        True
        >>> replayed = loads.load(load, [("w", torch.full((2, 2), 3.0))], model.parameters)  # without them
        >>> replayed is not None
        True
        >>> model.weight.tolist(), loads.replayed
        ([[3.0, 3.0], [3.0, 3.0]], 1)
    """

    def __init__(self, made: Callable[[Replay], Replay] | None = None) -> None:
        self._made = made  # what a replay is made into before it first runs (``summed_replay.py``), if anything
        self._records: dict[str, _TensorRecord] = {}
        self._computed: set[str] = set()  # names whose load did more than copies and fills: not watched again
        self.replayed = 0  # loads replayed so far
        self.recorded = 0  # loads that went through the loaders, watched

    def bind(self, name: str, tensor: torch.Tensor) -> BoundLoad | None:
        """The load of ``tensor`` as ``name``, resolved against it; ``None`` without a record that fits it."""
        record = self._records.get(name)
        if record is None or not record.fits(tensor):
            return None
        return BoundLoad(
            tuple(
                (step.destination, step.source_view(tensor), True)
                if isinstance(step, _Copy)
                else (step.destination, step.value, False)
                for step in record.steps
            )
        )

    def load(
        self,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
        weights: list[tuple[str, torch.Tensor]],
        held: Callable[[], Iterable[torch.Tensor]],
        bound: Sequence[BoundLoad | None] | None = None,
    ) -> Replay | None:
        """Load ``weights`` into the model whose parameters and buffers ``held()`` returns (asked only when
        recording): replayed when every tensor has a record that fits it, else through ``load_weights``, watched,
        its records replaced by what the load did (or dropped, if it did anything else than copies and fills).

        Args:
            bound: each tensor's load, bound already (a caller that keeps bindings between loads of the same
                tensors); bound here when ``None``.

        Returns:
            The replay that loaded them (:meth:`rerun` runs it again for the same tensors), or ``None``: they
            went through ``load_weights``.
        """
        if bound is None:
            bound = [self.bind(name, tensor) for name, tensor in weights]
        if weights and all(load is not None for load in bound):
            replay = Replay(load for load in bound if load is not None)
            if self._made is not None:
                replay = self._made(replay)
            self.rerun(replay)
            return replay
        names = [name for name, _ in weights]
        for name in names:
            self._records.pop(name, None)
        if self._computed.intersection(names):  # watching it again would find the same: load it as it is
            load_weights(weights)
            return None
        records = record_load(load_weights, weights, held())
        if not records:
            self._computed.update(names)
        self._records.update(records)
        self.recorded += 1
        return None

    def rerun(self, replay: Replay) -> None:
        """Run ``replay`` (made by :meth:`load`) again: the same tensors, holding new values."""
        replay.run()
        self.replayed += 1


def record_load(
    load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
    weights: list[tuple[str, torch.Tensor]],
    held: Iterable[torch.Tensor],
) -> dict[str, _TensorRecord]:
    """Run ``load_weights(weights)``, watching it; the record of each tensor whose load was copies and fills
    only (none if the load did anything else, or if two incoming tensors overlap in one storage)."""
    tensors = [tensor for _, tensor in weights]
    incoming = _Incoming(tensors)
    if not incoming.apart:
        load_weights(weights)
        return {}
    held_storages = {_storage(tensor) for tensor in held} - {0}  # (an empty tensor has no storage to tell apart)
    recorder = _Recorder(incoming, held_storages, tensors)
    with recorder:
        load_weights(weights)
    if not recorder.ok:
        return {}
    return {
        name: _TensorRecord(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, steps)
        for (name, tensor), steps in zip(weights, recorder.steps)
    }


class _Incoming:
    """The incoming tensors by the bytes they hold: several may be views of one storage (a MoE layer's experts, views
    of one fused tensor), each told apart by its own range of it."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (first byte, end byte, position)
        for position, tensor in enumerate(tensors):
            self.ranges.setdefault(_storage(tensor), []).append((*_bytes(tensor), position))
        for ranges in self.ranges.values():
            ranges.sort()
        self.storages = set(self.ranges)
        self.apart = 0 not in self.ranges and all(
            first[1] <= second[0] for ranges in self.ranges.values() for first, second in zip(ranges, ranges[1:])
        )

    def position_of(self, view: torch.Tensor) -> int | None:
        """The incoming tensor whose bytes hold all of ``view``'s, if one does."""
        start, end = _bytes(view)
        for first, last, position in self.ranges.get(_storage(view), ()):
            if first <= start and end <= last:
                return position
        return None


def _bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``tensor``'s elements span, ``[first, end)``."""
    size = tensor.element_size()
    span = sum((length - 1) * stride for length, stride in zip(tensor.shape, tensor.stride())) + 1
    start = int(tensor.storage_offset()) * size
    return start, start + (int(span) * size if tensor.numel() else 0)


def _views_of(out: Any, storages: set[int]) -> bool:
    """Whether ``out`` is one tensor or several, each in one of ``storages``."""
    outs = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
    return bool(outs) and all(_storage(tensor) in storages for tensor in outs)


class _Recorder(TorchDispatchMode):
    """Keeps, per incoming tensor, the copies of its views into parameters and the fills after them; notes
    anything else that reads an incoming tensor or writes a parameter (``ok`` turns ``False``)."""

    def __init__(self, incoming: _Incoming, held: set[int], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.incoming, self.held, self.tensors = incoming, held, tensors
        self.steps: list[list[_Copy | _Fill]] = [[] for _ in tensors]
        self.ok = True
        self._last: int | None = None  # the incoming tensor whose load is going on

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.ok:
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        storages = {_storage(tensor) for tensor in tensors}
        reads = storages & self.incoming.storages
        writes_held = bool(storages & self.held)
        if not reads and not writes_held:
            return  # nothing to do with the push
        if func is _aten.copy_.default and _storage(args[0]) in self.held and _storage(args[1]) in reads:
            position = self.incoming.position_of(args[1])
            # (A view as another dtype is not replayable by offsets.)
            if position is None or args[1].dtype != self.tensors[position].dtype:
                self.ok = False
                return
            source, offset = args[1], args[1].storage_offset() - self.tensors[position].storage_offset()
            self.steps[position].append(_Copy(args[0], tuple(source.shape), tuple(source.stride()), offset))
            self._last = position
        elif func is _aten.fill_.Scalar and _storage(args[0]) in self.held and not reads and self._last is not None:
            self.steps[self._last].append(_Fill(args[0], args[1]))
        elif not func._schema.is_mutable and _views_of(out, storages):
            return  # a view or views (``unbind``, ``split``) of an incoming tensor or of a parameter
        else:
            self.ok = False
