"""The fingerprints of ``weights/layer_sums.py`` on a GPU: one tensor's in one fused kernel (:func:`device_sums`), and
many tensors' in one kernel launch (:func:`batched_sums`).

Imported only where a GPU's tensors are summed: it imports Triton, which vLLM's CUDA build and PyTorch's CUDA
wheels bring.

A model's check sums hundreds of tensors on each side. One ``torch.compile`` kernel per tensor costs more host
time than device time: its guards and launch take tens of microseconds a tensor, and an 8B model's 291 tensors
took about 50 ms a side on an H200 that reads them all in 4 (docs/runs.md, run 27). Here one Triton kernel sums
every tensor of a dtype at once: its programs each take a span of one tensor, found in a table of the tensors'
addresses built once per layout, and add their three partial sums into that tensor's row of the output with
integer atomics (exact, in any order).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

_BLOCK = 1024  # values a program reads at once
# Blocks a program reads: a span of 64K values. Measured on an H100 (2026-12-07), an 8B model's bf16 weights: spans of
# 16K values summed in 6.9 ms and copied summing in 1.083x a copy's time, spans of 64K in 6.5 ms and 1.056x; spans of
# 16K or 32K in blocks of 512, 2048 or 4096 values were slower (docs/runs.md, run 58).
_STEPS = 64
# Tried on an H100 and put back (2026-12-07, docs/runs.md run 66): the non-finite test as one floating-point maximum a
# value (NaN kept) and offsets in int32 from a span's start. The summing copies ran at 1.007x a copy (1.036 before),
# but the trainer's read of 16 GB took 10.8 ms (6.8 before): the check's push took longer.
# A span's bfloat16 patterns (each in [-2**15, 2**15)) add up in int32 (_add_into_row): at most 2**16 of them fit.
assert _BLOCK * _STEPS <= 1 << 16
# A float32's exponent bits: a square's pattern with all of them set (at or above this, unsigned) is an inf or a NaN.
_NOT_FINITE = tl.constexpr(0x7F800000)
_USABLE = True  # False once building or running the kernel failed here: the per-tensor sums stand in
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Under Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is imported) the kernels run on a CPU's
# tensors: how the engine-free tests run them.
_KERNEL_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
_CHUNK_ELEMENTS = 1 << 22  # an eager float32 chunk: 16 MiB, whatever the tensor's size
# The fused kernel reduces rows of this many elements in parallel, then the row sums: a reduction of a
# whole tensor to one number in one pass would run on a handful of the GPU's cores.
_ROW_ELEMENTS = 1 << 12


def device_sums(flat: torch.Tensor) -> torch.Tensor:
    """``layer_sums.tensor_sums`` of ``flat`` (1-D, on a GPU, in the dtype to sum): one fused kernel reads it once
    (``torch.compile``); where that kernel cannot be built, float32 chunks of bounded size are summed."""
    if flat.is_cuda and _fused_sums.usable:
        try:
            return row_sums(flat, _fused_sums)
        except Exception as error:  # noqa: BLE001  # no compiler here: the eager sums are as exact, slower
            _fused_sums.usable = False
            log.warning("The fused weight sums could not be built (%s); summing in float32 chunks instead.", error)
    return _chunked_sums(flat)


def row_sums(flat: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``layer_sums.tensor_sums`` of ``flat``: ``kernel`` on its whole rows of ``_ROW_ELEMENTS``, the rest in chunks."""
    rows = flat.numel() // _ROW_ELEMENTS
    whole = rows * _ROW_ELEMENTS
    sums = kernel(flat[:whole].view(rows, _ROW_ELEMENTS)) if rows else None
    if whole == flat.numel() and sums is not None:
        return sums
    tail = _chunked_sums(flat[whole:])  # fewer than a row's elements
    return tail if sums is None else sums + tail


def _chunked_sums(flat: torch.Tensor) -> torch.Tensor:
    sums = torch.zeros(3, dtype=torch.int64, device=flat.device)
    for chunk in flat.split(_CHUNK_ELEMENTS):
        sums += _sums_kernel(chunk)
    return sums


def _sums_kernel(rows: torch.Tensor) -> torch.Tensor:
    values = rows.float()
    squared = values * values
    return torch.stack(
        [
            values.view(torch.int32).to(torch.int64).sum(),
            squared.view(torch.int32).to(torch.int64).sum(),
            (~torch.isfinite(squared)).to(torch.int64).sum(),
        ]
    )


class _FusedSums:
    """``_sums_kernel`` compiled once, for any number of rows (a dynamic shape), on first use."""

    usable = True

    def __init__(self) -> None:
        self._compiled: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self._compiled is None:
            self._compiled = torch.compile(_sums_kernel, dynamic=True, fullgraph=True)
        return self._compiled(rows)


_fused_sums = _FusedSums()


@triton.jit  # type: ignore[misc]
def _summed(values, bits, squares, worst, SHORT: tl.constexpr):  # fmt: skip
    """``bits``, ``squares`` and ``worst``, each lane's, with ``values`` added (a masked lane holds 0.0, which adds
    nothing). The squares' bit patterns add up in int32, wrapping: they are compared modulo 2**32. ``worst`` keeps
    the largest square's pattern, unsigned: one at or above ``_NOT_FINITE`` is an inf or a NaN, counted only then
    (:func:`_count_not_finite`), so that a finite span costs one integer operation a value for it, not four. With
    ``SHORT`` (bfloat16 values) ``bits`` adds up the values' own 16-bit patterns in int32 (a float32's pattern is
    one shifted left by 16: :func:`_add_into_row` shifts the sum once); else float32 patterns, in int64 (an int64 add
    is two of a GPU's integer operations, and the sums run beside copies that the memory bounds)."""
    if SHORT:
        bits += values.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        bits += values.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
    values = values.to(tl.float32)
    square_bits = (values * values).to(tl.int32, bitcast=True)
    return bits, squares + square_bits, tl.maximum(worst, square_bits.to(tl.uint32, bitcast=True))


@triton.jit  # type: ignore[misc]
def _count_not_finite(source, left, BLOCK: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
    """How many of a span's values (``left`` of them from ``source``, at most ``BLOCK * STEPS``) have a square that is
    not finite: read again, only for a span whose largest square is one."""
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for step in range(STEPS):
        offsets = step * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(source + offsets, mask=offsets < left, other=0.0).to(tl.float32)
        count += (((values * values).to(tl.int32, bitcast=True) & _NOT_FINITE) == _NOT_FINITE).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit  # type: ignore[misc]
def _add_into_row(out, row, bits, squares, not_finite, SHORT: tl.constexpr):  # fmt: skip
    """Add a span's sums into ``out[row]`` (``[bits, squares, not finite]``), with integer atomics: exact in any
    order (the squares modulo 2**32). A program's bfloat16 patterns, at most ``2**16`` of them, add up within int32."""
    total = tl.sum(bits, axis=0).to(tl.int64)
    if SHORT:
        total = total << 16
    tl.atomic_add(out + row * 3, total)
    tl.atomic_add(out + row * 3 + 1, tl.sum(squares, axis=0).to(tl.int64))
    tl.atomic_add(out + row * 3 + 2, not_finite.to(tl.int64))


def _span_table(numels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each span's tensor (int32) and first value (int64): every tensor of ``numels`` cut into spans of
    ``_BLOCK * _STEPS`` values, in order."""
    spans = (numels + _BLOCK * _STEPS - 1) // (_BLOCK * _STEPS)
    owner = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), spans)
    first = torch.cumsum(spans, 0) - spans
    return owner, (torch.arange(int(spans.sum()), dtype=torch.int64) - first[owner.long()]) * (_BLOCK * _STEPS)


class _Launch:
    """One launch of ``_sum_spans`` over tensors of one dtype, its table built once: the sources' and destinations'
    addresses, their sizes, each one's row of the sums, each span's tensor and start; ``aligned``: every address is
    (:func:`_aligned`)."""

    def __init__(
        self,
        dtype: torch.dtype,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        owners: Sequence[int],
        device: torch.device,
    ) -> None:
        self.dtype = dtype
        self.aligned = _aligned([*sources, *destinations])
        numels = torch.tensor([source.numel() for source in sources], dtype=torch.int64)
        item, start = _span_table(numels)
        table = (
            torch.tensor([source.data_ptr() for source in sources], dtype=torch.int64),
            torch.tensor([destination.data_ptr() for destination in destinations], dtype=torch.int64),
            numels,
            torch.tensor(owners, dtype=torch.int64),
            item,
            start,
        )
        self.table = tuple(t.to(device, non_blocking=True) for t in table)

    def run(self, out: torch.Tensor, copy: bool) -> None:
        """Sum every span into its row of ``out`` (with ``copy``, storing each value at its destination too)."""
        spans = self.table[4].numel()
        _sum_spans[(spans,)](
            *self.table, out, BLOCK=_BLOCK, STEPS=_STEPS, DTYPE=_triton_dtype(self.dtype), COPY=copy,
            SHORT=self.dtype == torch.bfloat16, ALIGNED=self.aligned,
        )  # fmt: skip


class _Layout:
    """How :func:`batched_sums` sums one list of tensors: one launch per dtype, each tensor's sums into its row."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.device = device
        by_dtype: dict[torch.dtype, list[int]] = {}
        for position, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(position)
        self.launches: list[_Launch] = []
        for dtype, positions in by_dtype.items():
            group = [tensors[position] for position in positions]
            self.launches.append(_Launch(dtype, group, group, positions, device))


def _layout_key(tensor: torch.Tensor) -> tuple[int, int, torch.dtype, bool]:
    """What a tensor's part of a launch rests on: its address (which names its device too), size, dtype and whether
    it is contiguous (the kernel reads ``numel`` values from the address)."""
    return tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.is_contiguous()


# The layouts of the lists summed lately, by their tensors' ``_layout_key``: a model's parameters stay where they are
# between pushes, and the host's work a tensor is what a push's launch costs (291 tensors on an 8B model). A list
# that cannot be summed here (another device, a dtype not summed here, a tensor not contiguous) is not kept.
_layouts: dict[tuple[tuple[int, int, torch.dtype, bool], ...], _Layout] = {}
_LAYOUTS_KEPT = 8  # (more than a process sums: the held tensors of each model pushed)


@triton.jit  # type: ignore[misc]
def _step(source, destination, offsets, left, bits, squares, worst, MASKED: tl.constexpr, COPY: tl.constexpr,
          SHORT: tl.constexpr):  # fmt: skip
    """One block of a span: its values read (a ``MASKED`` block up to ``left`` only), stored with ``COPY``, summed."""
    if MASKED:
        mask = offsets < left
        values = tl.load(source + offsets, mask=mask, other=0.0)
        if COPY:
            tl.store(destination + offsets, values, mask=mask)
    else:
        values = tl.load(source + offsets)
        if COPY:
            tl.store(destination + offsets, values)
    return _summed(values, bits, squares, worst, SHORT)


@triton.jit  # type: ignore[misc]
def _sum_spans(sources, destinations, numels, owners, span_item, span_start, out, BLOCK: tl.constexpr,
               STEPS: tl.constexpr, DTYPE: tl.constexpr, COPY: tl.constexpr, SHORT: tl.constexpr,
               ALIGNED: tl.constexpr):  # fmt: skip
    """Program ``i`` reads span ``i`` (``STEPS`` blocks of ``BLOCK`` values of item ``span_item[i]``, from
    ``span_start[i]``) and adds its sums into row ``owners[item]`` of ``out``; with ``COPY`` it also stores the values
    at ``destinations[item]``, so the sums are those of the values it wrote, taken from the registers that store
    them. ``ALIGNED``: every address is a multiple of 16 bytes.

    A whole span (all but a tensor's last) is read without a mask, and with ``ALIGNED`` 16 bytes a load: measured
    on an H100 the masked loads of 2 bytes each, their 64-bit offsets and compares made the read of an 8B model's 16
    GB bound by integer operations, not by memory (6.5 ms, 5.3 now: docs/runs.md run 67)."""
    span = tl.program_id(0)
    item = tl.load(span_item + span)
    start = tl.load(span_start + span)
    left = tl.load(numels + item) - start  # the tensor's values from the span's start
    owner = tl.load(owners + item)
    source = tl.load(sources + item).to(tl.pointer_type(DTYPE)) + start
    destination = source
    if COPY:
        destination = tl.load(destinations + item).to(tl.pointer_type(DTYPE)) + start
    if ALIGNED:  # (span starts are multiples of BLOCK values: the tensors' addresses decide)
        source = tl.multiple_of(source, 16)
        destination = tl.multiple_of(destination, 16)
    if SHORT:
        bits = tl.zeros([BLOCK], dtype=tl.int32)
    else:
        bits = tl.zeros([BLOCK], dtype=tl.int64)
    squares = tl.zeros([BLOCK], dtype=tl.int32)
    worst = tl.zeros([BLOCK], dtype=tl.uint32)
    if left >= BLOCK * STEPS:
        for step in range(STEPS):
            offsets = step * BLOCK + tl.arange(0, BLOCK)
            bits, squares, worst = _step(source, destination, offsets, left, bits, squares, worst, False, COPY, SHORT)
    else:
        for step in range(STEPS):
            offsets = step * BLOCK + tl.arange(0, BLOCK)
            bits, squares, worst = _step(source, destination, offsets, left, bits, squares, worst, True, COPY, SHORT)
    not_finite = 0
    if tl.max(worst, axis=0) >= _NOT_FINITE:
        not_finite = _count_not_finite(source, left, BLOCK, STEPS)
    _add_into_row(out, owner, bits, squares, not_finite, SHORT)


def _aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor's address is a multiple of 16 bytes (``_sum_spans``'s ``ALIGNED``): PyTorch's allocations
    are; a view into the middle of one may not be."""
    return all(tensor.data_ptr() % 16 == 0 for tensor in tensors)


class SummedCopies:
    """Copies that sum what they write: ``(destination, source, owner)``, both contiguous, of one dtype, on one CUDA
    GPU; :meth:`run` makes every copy and adds the sums of the values each wrote (``[bits, squares, not finite]``,
    as :func:`batched_sums` takes them) into row ``owner`` of its output, in one launch per dtype. The launch tables
    are built here, once: the copies of a kept replay are the same at every push.

    One pass reads and writes each value, as a copy does; its sums are those a second read of the destinations
    would take, since every value summed is the one stored.

    Raises:
        ValueError: a copy this cannot make (not contiguous, dtypes or sizes that differ, not on one CUDA device,
            a dtype not summed here).
    """

    def __init__(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor, int]], owners: int) -> None:
        if not copies:
            raise ValueError("no copies to make")
        self.device = copies[0][0].device
        self.owners = owners
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        for destination, source, owner in copies:
            if (
                destination.device != self.device
                or source.device != self.device
                or self.device.type != _KERNEL_DEVICE
                or destination.dtype != source.dtype
                or destination.dtype not in _DTYPES
                or destination.numel() != source.numel()
                or not (destination.is_contiguous() and source.is_contiguous())
                or not 0 <= owner < owners
            ):
                raise ValueError(f"cannot copy and sum {tuple(source.shape)} into {tuple(destination.shape)} here")
            by_dtype.setdefault(destination.dtype, []).append((destination, source, owner))
        self._launches = [
            _Launch(dtype, [s for _, s, _ in group], [d for d, _, _ in group], [o for _, _, o in group], self.device)
            for dtype, group in by_dtype.items()
        ]
        self._held = [(d, s) for d, s, _ in copies]  # (the tables hold addresses: the tensors must stay alive)

    def run(self) -> torch.Tensor:
        """Make every copy on the current stream; the sums of what each owner's copies wrote, ``[owners, 3]`` int64
        on the GPU (nothing synchronizes)."""
        out = torch.zeros(self.owners, 3, dtype=torch.int64, device=self.device)
        for launch in self._launches:
            launch.run(out, copy=True)
        return out


def batched_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[[bits, squares, not finite], ...]`` (``layer_sums.tensor_sums``, the squares' sum exact), one row per
    tensor, as int64 on their GPU, in one launch per dtype; nothing synchronizes. ``None`` when this cannot run
    here (no Triton, a tensor not contiguous or not on one CUDA device, another dtype): the caller sums them one
    by one."""
    global _USABLE
    if not _USABLE or not tensors:
        return None
    key = tuple(map(_layout_key, tensors))
    layout = _layouts.get(key)
    if layout is None:
        device = tensors[0].device
        if device.type != _KERNEL_DEVICE or any(
            t.device != device or t.dtype not in _DTYPES or not t.is_contiguous() for t in tensors
        ):
            return None
        if len(_layouts) >= _LAYOUTS_KEPT:
            _layouts.clear()
        layout = _layouts[key] = _Layout(tensors, device)
    try:
        out = torch.zeros(len(tensors), 3, dtype=torch.int64, device=layout.device)
        for launch in layout.launches:
            launch.run(out, copy=False)
        return out
    except Exception as error:  # noqa: BLE001  # no usable Triton here: the per-tensor sums are as exact
        _USABLE = False
        log.warning("The batched weight sums could not run (%s); summing tensor by tensor instead.", error)
        return None


def _triton_dtype(dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
