"""The fingerprints of many tensors on a GPU in one kernel launch (``weights/layer_sums.py`` defines them).

Imported only where a GPU's tensors are summed: it imports Triton, which vLLM's CUDA build and PyTorch's CUDA
wheels bring.

A model's check sums hundreds of tensors on each side. One ``torch.compile`` kernel per tensor costs more host
time than device time: its guards and launch take tens of microseconds a tensor, and an 8B model's 291 tensors
took about 50 ms a side on an H200 that reads them all in 4 (docs/gpu.md, run 27). Here one Triton kernel sums
every tensor of a dtype at once: its programs each take a span of one tensor, found in a table of the tensors'
addresses built once per layout, and add their three partial sums into that tensor's row of the output with
integer atomics (exact, in any order).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

_BLOCK = 1024  # values a program reads at once
_STEPS = 16  # blocks a program reads: a span of 16K values
_USABLE = True  # False once building or running the kernel failed here: the per-tensor sums stand in
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit  # type: ignore[misc]
def _sums_of_spans(addresses, numels, span_owner, span_start, out, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                   DTYPE: tl.constexpr):  # fmt: skip
    """Program ``i`` sums span ``i``: ``STEPS`` blocks of ``BLOCK`` values of tensor ``span_owner[i]``, from
    ``span_start[i]``, and adds its sums into that tensor's row of ``out``."""
    span = tl.program_id(0)
    owner = tl.load(span_owner + span)
    start = tl.load(span_start + span)
    numel = tl.load(numels + owner)
    base = tl.load(addresses + owner).to(tl.pointer_type(DTYPE))
    bits = tl.zeros([BLOCK], dtype=tl.int64)
    squares = tl.zeros([BLOCK], dtype=tl.int64)
    not_finite = tl.zeros([BLOCK], dtype=tl.int32)
    for step in range(STEPS):
        offsets = start + step * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(base + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
        squared = values * values
        bits += values.to(tl.int32, bitcast=True).to(tl.int64)
        square_bits = squared.to(tl.int32, bitcast=True)
        squares += square_bits.to(tl.int64)
        not_finite += ((square_bits & 0x7F800000) == 0x7F800000).to(tl.int32)  # (a masked lane is 0.0)
    tl.atomic_add(out + owner * 3, tl.sum(bits, axis=0))
    tl.atomic_add(out + owner * 3 + 1, tl.sum(squares, axis=0))
    tl.atomic_add(out + owner * 3 + 2, tl.sum(not_finite, axis=0).to(tl.int64))


class _Spans:
    """The launch table of one list of tensors (addresses, sizes, each span's tensor and start), kept for the next
    call with the same tensors: a model's parameters stay where they are between pushes."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._table: tuple[torch.Tensor, ...] = ()

    def table(self, tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
        key = tuple((tensor.data_ptr(), tensor.numel()) for tensor in tensors)
        if key != self._key:
            numels = torch.tensor([tensor.numel() for tensor in tensors], dtype=torch.int64)
            spans = (numels + _BLOCK * _STEPS - 1) // (_BLOCK * _STEPS)
            owner = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32), spans)
            first = torch.cumsum(spans, 0) - spans
            start = (torch.arange(int(spans.sum()), dtype=torch.int64) - first[owner.long()]) * (_BLOCK * _STEPS)
            addresses = torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.int64)
            self._table = tuple(t.to(device, non_blocking=True) for t in (addresses, numels, owner, start))
            self._key = key
        return self._table


_tables: dict[tuple[torch.device, torch.dtype, int], _Spans] = {}


def batched_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[[bits, squares, not finite], ...]`` (``layer_sums.tensor_sums``, the squares' sum exact), one row per
    tensor, as int64 on their GPU, in one launch per dtype; nothing synchronizes. ``None`` when this cannot run
    here (no Triton, a tensor not contiguous or not on one CUDA device, another dtype): the caller sums them one
    by one."""
    global _USABLE
    if not _USABLE or not tensors:
        return None
    device = tensors[0].device
    if device.type != "cuda" or any(
        t.device != device or t.dtype not in _DTYPES or not t.is_contiguous() for t in tensors
    ):
        return None
    try:
        out = torch.zeros(len(tensors), 3, dtype=torch.int64, device=device)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for position, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(position)
        for dtype, positions in by_dtype.items():
            group = [tensors[p] for p in positions]
            spans = _tables.setdefault((device, dtype, len(by_dtype)), _Spans())
            addresses, numels, owner, start = spans.table(group, device)
            rows = out if len(by_dtype) == 1 else torch.zeros(len(group), 3, dtype=torch.int64, device=device)
            _sums_of_spans[(owner.numel(),)](
                addresses, numels, owner, start, rows, BLOCK=_BLOCK, STEPS=_STEPS, DTYPE=_triton_dtype(dtype)
            )
            if rows is not out:
                out[torch.tensor(positions, device=device)] = rows
        return out
    except Exception as error:  # noqa: BLE001  # no usable Triton here: the per-tensor sums are as exact
        _USABLE = False
        log.warning("The batched weight sums could not run (%s); summing tensor by tensor instead.", error)
        return None


def _triton_dtype(dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
