"""The CPU fingerprints' compiled loops (``weights/cpu_loops.py``); ``test_layer_sums.py`` holds them against the
fingerprint's definition and numpy's passes."""

from __future__ import annotations

import torch

from lightning_vllm.weights import layer_sums


def test_vllms_kernel_scan_at_a_cpu_workers_start_reads_every_module_after_the_sums_imported_numba():
    """vLLM's CPU build, as a worker starts, reads ``vars()`` of every module-level value that has a ``__dict__``;
    numba's LLVM library wrapper answered ``__dict__`` with a C function, and the worker failed to start
    (``cpu_loops._no_dunders_from``)."""
    from vllm.triton_utils.dispatcher import _rebind_kernels

    layer_sums.tensor_sums(torch.ones(3, dtype=torch.bfloat16))  # (imports numba, on first use in this process)
    _rebind_kernels([])  # (the scan, with no kernel to replace)
