"""Fingerprints of the values vLLM's CPU build packs a layer from, taken as it packs them.

vLLM's CPU build packs an unquantized linear layer's weight for oneDNN (or its small-GEMM kernel) when it processes
the layer after loading (``dispatch_cpu_unquantized_gemm``), and empties ``weight``: what the layer computes with is
opaque from then on. So a load wrapped in :func:`packing_fingerprinted` fingerprints each weight where the loader wrote
it, the moment before it is packed, by destination layer, and the fingerprint stays with the layer
(:func:`packed_from`) until it is packed again. The check after every push (``layer_sums.held_layer_sums``) takes it
for the layer's values, and holds it against a weight that is still live: an embedding, the output embedding tied to
it, or a linear layer whose processing was skipped. If those differ, the pack was built from other values than the
layer holds (the stale pack ``backends/gloo/tied_embedding_fix.py`` exists for), and the layer is named.

The fingerprint costs one read of the weight, while the loader has just written it; packing then reads it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from weakref import WeakKeyDictionary

import torch

from lightning_vllm.weights.layer_sums import tensor_sums

# Kept beside the layer, not on it: dropped with the layer, and a fingerprint is a fact of the pack, which the layer
# keeps until it is packed again (then replaced here, the one place that writes it).
_PACKED_FROM: WeakKeyDictionary[torch.nn.Module, torch.Tensor] = WeakKeyDictionary()


def packed_from(layer: torch.nn.Module) -> torch.Tensor | None:
    """The fingerprint (``layer_sums.tensor_sums``) of the values ``layer``'s pack was built from, if it was built
    inside :func:`packing_fingerprinted`."""
    return _PACKED_FROM.get(layer)


def any_packed() -> bool:
    """Whether any layer of this process was packed inside :func:`packing_fingerprinted` (and is alive)."""
    return len(_PACKED_FROM) > 0


@contextmanager
def packing_fingerprinted() -> Iterator[None]:
    """While open, every layer vLLM's CPU build packs is fingerprinted first (see the module docstring).

    vLLM imports ``dispatch_cpu_unquantized_gemm`` from its module at each call, so replacing it there for the
    duration of a load reaches every layer the load processes, and nothing outside it.
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def fingerprint_then_pack(layer: torch.nn.Module, remove_weight: bool) -> Any:
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and not weight.is_meta and weight.dim() == 2 and weight.numel():
            _PACKED_FROM[layer] = tensor_sums(weight)
        else:  # (packed from nothing we can fingerprint: vLLM leaves such a layer unpacked or computes otherwise)
            _PACKED_FROM.pop(layer, None)
        return dispatch(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = fingerprint_then_pack
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch
