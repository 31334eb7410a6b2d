"""A workaround for vLLM 0.32 and 0.33 on CPU: an updated MoE layer computes with its experts unpacked.

vLLM's CPU experts (``CPUUnquantizedExperts``) prepack a MoE layer's expert weights into their grouped-gemm layout
when the layer is first processed. A weight update processes the layer again (layer-wise reload), but
``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' own processing only while no kernel exists yet: the
new weights stay in the checkpoint's layout, and the kernel reads them as packed. vLLM's own ``reload_weights`` does
the same: a tiny Qwen3-MoE reloaded from another checkpoint served logprobs 0.044 away from it, against 5e-7 when
started from it. Here the skipped step runs after the reload, for the MoE layers the reload processed, and only
those (a changed-only push that left a layer's experts out must not pack them twice). Remove this module once vLLM
prepacks on updates.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_vllm.backends.gloo.tied_embedding_fix import processing_recorded


@contextmanager
def cpu_experts_repacked(model: torch.nn.Module) -> Iterator[None]:
    """Around a layer-wise reload: afterwards, prepack the experts of every MoE layer the reload processed."""
    layers = {id(module): (module, experts) for module in model.modules() if (experts := _cpu_experts(module))}
    with processing_recorded([module.quant_method for module, _ in layers.values()]) as processed:
        yield
    for key in processed & layers.keys():
        module, experts = layers[key]
        experts.process_weights_after_loading(module)


def _cpu_experts(module: torch.nn.Module) -> Any:
    """The CPU experts that prepack ``module``'s weights, if it is a MoE layer that has them."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # (a vLLM without CPU experts)
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) else None
