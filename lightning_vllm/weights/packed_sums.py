"""Fingerprints of the values vLLM's CPU build packs a layer from, taken as it packs them.

vLLM's CPU build packs an unquantized linear layer's weight for oneDNN (or its small-GEMM kernel) when it processes
the layer after loading (``dispatch_cpu_unquantized_gemm``), and empties ``weight``: what the layer computes with is
opaque from then on. So a load wrapped in :func:`packing_fingerprinted` fingerprints each weight where the loader wrote
it, the moment before it is packed, by destination layer, and the fingerprint stays with the layer
(:func:`packed_from`) until it is packed again. The check after every push (``layer_sums.held_layer_sums``) takes it
for the layer's values, and holds it against a weight that is still live: an embedding, the output embedding tied to
it, or a linear layer whose processing was skipped. If those differ, the pack was built from other values than the
layer holds (the stale pack ``backends/gloo/tied_embedding_fix.py`` exists for), and the layer is named.

Where vLLM cannot pack a layer (oneDNN refuses the shape or dtype: bfloat16 on a CPU without AVX512-BF16), it leaves
the weight live and computes with it. vLLM's layer-wise reload processes a layer in fresh tensors, then copies them
into the tensors the layer held (``_copy_and_restore_kernel_tensors``: a copy of equal shapes, exact). So the
fingerprint taken the moment before the pack would have been built holds for the weight the layer holds once the load
ends, as long as nothing wrote it since: :func:`loaded_as` gives it for the layers the last load processed, so that the
check does not read them a second time (as on a GPU the sums the copies took, ``held_sums.SumsWhatItWrites``). A layer
the last load did not process, or whose weight was replaced since, is read live: whatever wrote it since its load is
caught.

The fingerprint costs one read of the weight, while the loader has just written it; packing then reads it again. That
read runs on a thread of its own (:func:`_fingerprinter`), beside the packing and the loading of the layers after it,
on the cores vLLM did not bind the worker to (a trainer waits for the load meanwhile): the load waits for the last
fingerprints only as it ends. The thread holds the weight until it has read it, so a weight the pack replaces is read
as the loader wrote it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any
from weakref import WeakKeyDictionary, ref

import torch

from lightning_vllm.settings import DEFAULT_TIMEOUT_SECONDS
from lightning_vllm.weights.layer_sums import tensor_sums

# Kept beside the layer, not on it: dropped with the layer, and a fingerprint is a fact of the pack, which the layer
# keeps until it is packed again (then replaced here, the one place that writes it).
_PACKED_FROM: WeakKeyDictionary[torch.nn.Module, torch.Tensor] = WeakKeyDictionary()
# The layers the last load processed and vLLM left computing with their live weight: the weight the layer held when
# the load ended (by reference and address, so that a weight replaced since is read again) and its fingerprint.
# Emptied as each load begins, filled as it ends.
_LOADED_AS: WeakKeyDictionary[torch.nn.Module, tuple[ref[torch.Tensor], int, torch.Tensor]] = WeakKeyDictionary()


def packed_from(layer: torch.nn.Module) -> torch.Tensor | None:
    """The fingerprint (``layer_sums.tensor_sums``) of the values ``layer``'s pack was built from, if it was built
    inside :func:`packing_fingerprinted`."""
    return _PACKED_FROM.get(layer)


def loaded_as(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The fingerprint of ``weight`` as the last load left it, if that load processed ``layer`` inside
    :func:`packing_fingerprinted` and vLLM computes with the weight as it is (it could not pack it); else ``None``."""
    found = _LOADED_AS.get(layer)
    if found is None:
        return None
    held, address, sums = found
    return sums if held() is weight and weight.data_ptr() == address else None


def any_packed() -> bool:
    """Whether any layer of this process was packed inside :func:`packing_fingerprinted` (and is alive)."""
    return len(_PACKED_FROM) > 0


@contextmanager
def packing_fingerprinted(fingerprint: bool = True) -> Iterator[None]:
    """While open, every layer vLLM's CPU build packs is fingerprinted first (see the module docstring).

    vLLM imports ``dispatch_cpu_unquantized_gemm`` from its module at each call, so replacing it there for the
    duration of a load reaches every layer the load processes, and nothing outside it.

    Args:
        fingerprint: ``False`` for a load no check follows (an unchecked push): the layers it processes are only
            forgotten (their fingerprints would be of earlier values), which spares a read of every linear weight
            (0.68 s of a 1.46 s push at 400M on 2 CPU cores). A later check says such a layer cannot be verified
            until a checked push sends it.
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    # The layers this load packed, and those it left computing with their live weight (its numel), with the
    # fingerprints being taken beside the load.
    packed: WeakKeyDictionary[torch.nn.Module, Future[torch.Tensor]] = WeakKeyDictionary()
    processed: WeakKeyDictionary[torch.nn.Module, tuple[int, Future[torch.Tensor]]] = WeakKeyDictionary()

    def fingerprint_then_pack(layer: torch.nn.Module, remove_weight: bool) -> Any:
        weight = getattr(layer, "weight", None)
        processed.pop(layer, None)
        packed.pop(layer, None)
        _PACKED_FROM.pop(layer, None)
        if not fingerprint:
            return dispatch(layer, remove_weight)
        if not (isinstance(weight, torch.Tensor) and not weight.is_meta and weight.dim() == 2 and weight.numel()):
            return dispatch(layer, remove_weight)  # (nothing to fingerprint: vLLM leaves it or computes otherwise)
        # (Held by the thread until it has read it; a process forked from one that had the thread has none.)
        sums = _fingerprinter(os.getpid()).submit(tensor_sums, weight.detach())
        done = dispatch(layer, remove_weight)
        if remove_weight and layer.weight is weight and weight.numel():  # not packed: computes with the live weight
            processed[layer] = (weight.numel(), sums)
        else:
            packed[layer] = sums
        return done

    _LOADED_AS.clear()  # (a weight of an earlier load may be written by this one, even if this one fails)
    utils.dispatch_cpu_unquantized_gemm = fingerprint_then_pack
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch
        # (Also when the load failed: the packs it built stand, and a check names what they hold.)
        for layer, sums in packed.items():
            _PACKED_FROM[layer] = sums.result(timeout=DEFAULT_TIMEOUT_SECONDS)  # (sums of tensors in memory: end)
    for layer, (numel, sums) in processed.items():  # (the load ended: bound to the weights vLLM copied back)
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == numel:
            _LOADED_AS[layer] = (ref(weight), weight.data_ptr(), sums.result(timeout=DEFAULT_TIMEOUT_SECONDS))


@functools.cache
def _fingerprinter(process: int) -> ThreadPoolExecutor:
    """The one thread of ``process`` (this one's id) that fingerprints weights beside the load (see the module
    docstring)."""
    return ThreadPoolExecutor(1, thread_name_prefix="lightning-vllm: fingerprints", initializer=_off_the_bound_cores)


def _off_the_bound_cores() -> None:
    """Move the calling thread to the cores its process may use that vLLM did not bind the worker's thread to.

    vLLM's CPU worker binds its thread to its cores (``VLLM_CPU_OMP_THREADS_BIND``, ``auto``: one per worker, here
    1 of 2), and a thread starts bound as its starter is. While a load runs, the trainer waits for it, so another core
    is idle. Where there is none (the worker was given every core), the thread stays where it started.
    """
    bound = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - bound
    if others:
        try:
            os.sched_setaffinity(0, others)
        except OSError:  # (none of them is this process's to use: its cgroup's cpuset)
            pass
