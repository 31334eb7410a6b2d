"""A workaround for vLLM 0.32 on CPU: a tied output embedding keeps its old packed weights.

The output embedding of a model that ties it to the input embedding (``lm_head``)
loads no weight of its own, so layer-wise reload does not re-process it, and it
keeps computing logits from the packed (oneDNN) copy of the *old* embedding it made
at start. vLLM's own ``reload_weights`` does the same. Remove this module once vLLM
re-processes tied layers itself.
"""

from __future__ import annotations

import torch


def refresh_tied_embeddings(model: torch.nn.Module) -> None:
    """Re-process embedding layers that share their weight with another layer.

    Their weight tensor is the new one, so re-running their processing rebuilds the
    packed copy. Unquantized embeddings only: their processing just repacks and can
    run again safely.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    for modules in holders.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
