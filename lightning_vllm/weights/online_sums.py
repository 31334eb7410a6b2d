"""Fingerprints of the values vLLM's online quantization quantizes a layer from, taken as it quantizes them.

An engine started from a bf16 checkpoint with ``quantization="fp8_per_block"`` (or ``"fp8_per_tensor"``,
``"fp8_per_channel"``: vLLM's *online* FP8, ``layers/quantization/online/fp8.py``) loads each linear layer and each
MoE block in bf16 and quantizes it as it processes it, at start and at every push (layer-wise reload): from then on
the layer holds e4m3 values and scales of vLLM's making. A push to it sends the bf16 checkpoint form, so the check
after the push cannot hold the layer's live values against what was sent. It holds the values vLLM quantized from:
:func:`fingerprinting_online_quantization` fingerprints each such layer's parameters the moment before vLLM quantizes
them, and the fingerprint stays with the layer (:func:`quantized_from`) until it is quantized again.

What that proves: every value the trainer sent reached the layer it belongs to, and vLLM quantized those. What it
does not: the quantization itself, which is vLLM's, a pure function of those values (an engine that loaded the same
bf16 weights at start holds the same bytes: ``tests/gpu/test_gpu_fp8.py`` compares digests), nor a write into the
quantized values after it (an engine's own fault there is not what a push causes).

vLLM enters ``online_quantization_timing_context(layer, quant_method)`` around every online quantization, at start
(``model_loader/utils.py``) and in a reload (``reload/layerwise.py``, which imports it at each call), so replacing it
in its module reaches both. Our plugin does that in each worker before vLLM loads the model
(``in_vllm/worker_methods.py``: the worker wrapper's ``load_model``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any
from weakref import WeakKeyDictionary

import torch

from lightning_vllm.weights.layer_sums import fused_experts, sums_of_many

# Beside the layer, not on it: dropped with the layer; written only as a quantization ends (the one place).
_QUANTIZED_FROM: WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = WeakKeyDictionary()
_WRAPPED = "_lightning_vllm_fingerprinted"  # marks our context on vLLM's module (set once per process)


def quantized_from(layer: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """``{parameter name: fingerprint}`` of the values vLLM's online quantization last quantized ``layer`` from:
    ``[bits, squares, not finite]`` (``layer_sums.tensor_sums``), a row per routed expert for a fused expert tensor
    (``[experts, 3]``); ``None`` if no online quantization of ``layer`` was fingerprinted."""
    return _QUANTIZED_FROM.get(layer)


def is_online_quantized(layer: torch.nn.Module) -> bool:
    """Whether vLLM quantizes ``layer`` online as it loads it (its ``quant_method`` is one of vLLM's online methods)."""
    method = getattr(layer, "quant_method", None)
    return method is not None and isinstance(method, _online_methods())


@functools.cache
def _online_methods() -> tuple[type, ...]:
    """vLLM's base classes of its online quantization methods (asked for every linear layer at every check)."""
    try:
        from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase
        from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase
    except ImportError:  # (a vLLM without online quantization quantizes nothing online)
        return ()
    return (OnlineLinearBase, OnlineMoEMethodBase)


def fingerprinting_online_quantization() -> None:
    """Put :func:`_fingerprinted` in place of vLLM's ``online_quantization_timing_context`` in this process (once)."""
    from vllm.model_executor.model_loader import utils

    timing = utils.online_quantization_timing_context
    if not getattr(timing, _WRAPPED, False):
        utils.online_quantization_timing_context = _fingerprinted(timing)


def _fingerprinted(timing: Callable[..., AbstractContextManager[Any]]) -> Callable[..., AbstractContextManager[Any]]:
    @contextmanager
    def fingerprinted(layer: torch.nn.Module, quant_method: Any) -> Iterator[None]:
        taken = layer_fingerprints(layer)  # (queued on the layer's device before the quantization's kernels)
        with timing(layer, quant_method):
            yield
        _QUANTIZED_FROM[layer] = taken  # (a quantization that raised leaves the last fingerprint, of what it holds)

    setattr(fingerprinted, _WRAPPED, True)
    return fingerprinted


def layer_fingerprints(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fingerprints of ``layer``'s own floating-point parameters as they are now, a row per routed expert for a
    fused expert tensor (``layer_sums.fused_experts``, as ``held_sums`` sums the held ones). Meta tensors (not loaded)
    are left out.

    Example::

        >>> layer = torch.nn.Linear(2, 2, bias=False)
        >>> sorted(layer_fingerprints(layer)), layer_fingerprints(layer)["weight"].shape
        (['weight'], torch.Size([3]))
    """
    parts: list[tuple[str, int]] = []  # (name, the routed experts it holds as rows, else 0)
    tensors: list[torch.Tensor] = []
    for name, parameter in layer.named_parameters(recurse=False):
        if parameter.is_meta or not parameter.dtype.is_floating_point:
            continue
        values = parameter.detach()
        experts = fused_experts(layer, values)
        parts.append((name, experts))
        tensors.extend(values.unbind(0) if experts else [values])
    # (All of them at once: on a GPU one launch per dtype, not one per expert row: a reload runs this per layer.)
    sums = iter(sums_of_many(tensors, [None] * len(tensors)))
    return {
        name: torch.stack([next(sums) for _ in range(experts)]) if experts else next(sums) for name, experts in parts
    }
