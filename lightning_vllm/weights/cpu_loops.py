"""The CPU fingerprints' inner loops (``layer_sums.cpu_sums`` drives them a chunk at a time): compiled by numba, one
pass over a chunk's bit patterns; numpy's passes where numba is missing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

# The loops below take a chunk's bit patterns (bfloat16: int16, its bits' sum not yet shifted left by 16; float32:
# int32) and give (bits, squares, not finite). They read numba's bit casts between an uint32 and a float32 as
# globals, set by compiled_loops before it compiles them.
_as_float32: Any = None
_bits_of: Any = None


# Two loops, not one with the shift as an argument: that one took 0.37 to 0.44 ns a bfloat16 value against 0.31 to
# 0.36 (measured side by side, 2026-12-07). The squares and the count of non-finite ones add up in uint32 lanes,
# wrapping (the squares are compared modulo 2**32; a chunk holds far fewer than 2**32 values): 0.11 ns a bfloat16 value
# against 0.21 with both in 64 bits (2026-12-07, 64M values on one core of this machine; numba vectorizes either, and
# 32-bit lanes hold twice the values). The bits' sum stays in int64: a chunk of the largest patterns overflows int32.
def _bfloat16_sums(patterns: np.ndarray) -> tuple[Any, Any, Any]:
    bits, squares, not_finite = np.int64(0), np.uint32(0), np.uint32(0)
    for index in range(patterns.shape[0]):
        pattern = patterns[index]
        bits += np.int64(pattern)
        value = _as_float32(np.uint32(np.uint16(pattern)) << np.uint32(16))
        square = _bits_of(value * value)
        squares = np.uint32(squares + square)
        not_finite = np.uint32(not_finite + np.uint32(square & np.uint32(0x7F800000) == np.uint32(0x7F800000)))
    return bits, squares, not_finite


def _float32_sums(patterns: np.ndarray) -> tuple[Any, Any, Any]:
    bits, squares, not_finite = np.int64(0), np.uint32(0), np.uint32(0)
    for index in range(patterns.shape[0]):
        pattern = patterns[index]
        bits += np.int64(pattern)
        value = _as_float32(np.uint32(pattern))
        square = _bits_of(value * value)
        squares = np.uint32(squares + square)
        not_finite = np.uint32(not_finite + np.uint32(square & np.uint32(0x7F800000) == np.uint32(0x7F800000)))
    return bits, squares, not_finite


@functools.cache
def compiled_loops() -> tuple[
    Callable[[np.ndarray], tuple[Any, Any, Any]], Callable[[np.ndarray], tuple[Any, Any, Any]]
]:
    """The bfloat16 and the float32 loop above, compiled by numba (a dependency of vLLM, both builds) on first use in
    a process, and cached on disk beside this module: one pass a value, every sum in registers. Measured on 2 cores of
    an AMD EPYC, one thread, 64M bfloat16 values: 0.11 ns a value, against 0.82 for torch's five passes over chunks
    the core's cache holds (before 2026-12-07). Where numba is missing (a trainer without vLLM, pushing to a
    ``vllm serve``): numpy's passes (:func:`_numpy_sums`), slower."""
    try:
        import numba
        from llvmlite import ir
        from llvmlite.binding import ffi
        from numba.extending import intrinsic
    except ImportError:
        return _numpy_sums, _numpy_sums
    _no_dunders_from(type(ffi.lib))

    @intrinsic
    def as_float32(typing_context: Any, bits: Any) -> Any:
        return numba.float32(numba.uint32), lambda context, builder, signature, args: builder.bitcast(
            args[0], ir.FloatType()
        )

    @intrinsic
    def bits_of(typing_context: Any, value: Any) -> Any:
        return numba.uint32(numba.float32), lambda context, builder, signature, args: builder.bitcast(
            args[0], ir.IntType(32)
        )

    global _as_float32, _bits_of
    _as_float32, _bits_of = as_float32, bits_of
    try:  # (nogil: the trainer's sums run on a thread beside the push)
        return numba.njit(nogil=True, cache=True)(_bfloat16_sums), numba.njit(nogil=True, cache=True)(_float32_sums)
    except RuntimeError:  # (numba finds no folder it may write its cache to: compiled in each process)
        return numba.njit(nogil=True)(_bfloat16_sums), numba.njit(nogil=True)(_float32_sums)


def _numpy_sums(patterns: np.ndarray) -> tuple[int, int, int]:
    """What the loops above give, in numpy's passes over the chunk."""
    values = (patterns.astype(np.int32) << 16 if patterns.dtype == np.int16 else patterns).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # (an inf or NaN square is counted, not warned of)
        squared = values * values
    not_finite = int((~np.isfinite(squared)).sum())
    return int(patterns.sum(dtype=np.int64)), int(squared.view(np.uint32).sum(dtype=np.uint64)), not_finite


def _no_dunders_from(library_class: type) -> None:
    """Keep ``library_class`` (llvmlite's ``_lib_wrapper``, whose ``__getattr__`` wraps a C function of LLVM's library
    for any name asked) from answering names of Python's own, ``__dict__`` among them: it has none (``__slots__``).

    vLLM's CPU build (0.32 and 0.33, without Triton), as each worker starts, looks through every module of its process
    for Triton kernels to replace, and reads ``vars(value)`` of each value that ``hasattr(value, "__dict__")``
    (``vllm/triton_utils/dispatcher.py``). ``llvmlite.binding.ffi.lib`` answered with a wrapped function, the read
    raised ``AttributeError``, and a worker started in a process where numba was imported before (an in-process
    engine started after a checked push) failed to start. C symbols of llvmlite's library never begin with ``__``.
    """
    answer = library_class.__getattr__  # type: ignore[attr-defined]
    if getattr(answer, "no_dunders", False):
        return

    def __getattr__(self: object, name: str) -> Any:  # noqa: N807
        if name.startswith("__"):
            raise AttributeError(name)
        return answer(self, name)

    __getattr__.no_dunders = True  # type: ignore[attr-defined]
    library_class.__getattr__ = __getattr__  # type: ignore[attr-defined]
