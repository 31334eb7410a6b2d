"""A workaround for vLLM 0.32 on CPU: a tied output embedding keeps its old packed weights.

The output embedding of a model that ties it to the input embedding (``lm_head``)
loads no weight of its own, so layer-wise reload does not re-process it, and it
keeps computing logits from the packed (oneDNN) copy of the *old* embedding it made
at start. vLLM's own ``reload_weights`` does the same. Remove this module once vLLM
re-processes tied layers itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def tied_embeddings_refreshed(model: torch.nn.Module) -> Iterator[None]:
    """Around a layer-wise reload: afterwards, re-process the layers that share a weight with a layer
    the reload processed (the tied output embedding), and only those.

    Each processing of an embedding repacks the whole matrix (on a 400M model with a 65k vocabulary
    it was a sixth of the worker's time in a push), so neither the input embedding, which the reload
    has just processed, nor a tied group the update left out (a changed-only push with frozen
    embeddings) is repacked. Which layers the reload processed is recorded by wrapping their
    processing for the duration, so it does not depend on how vLLM names them.
    """
    groups = _tied_embedding_groups(model)
    methods = {id(_method(module)): _method(module) for group in groups for module in group}
    with processing_recorded(list(methods.values())) as processed:
        yield
    for group in groups:
        if any(id(module) in processed for module in group):
            for module in group:
                if id(module) not in processed:
                    _method(module).process_weights_after_loading(module)


@contextmanager
def processing_recorded(methods: list[Any]) -> Iterator[set[int]]:
    """The ids of the layers that ``methods`` process (``process_weights_after_loading``) while it is open; also
    used by ``moe_prepack_fix.py``."""
    processed: set[int] = set()
    for method in methods:
        method.process_weights_after_loading = _recording(method.process_weights_after_loading, processed)
    try:
        yield processed
    finally:
        for method in methods:
            del method.process_weights_after_loading  # the class's own again


def _method(module: torch.nn.Module) -> Any:
    return getattr(module, "quant_method")  # noqa: B009  # (typed as a tensor or module otherwise)


def _recording(process: Any, processed: set[int]) -> Any:
    def process_and_record(layer: torch.nn.Module) -> Any:
        processed.add(id(layer))
        return process(layer)

    return process_and_record


def _tied_embedding_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Unquantized embedding layers that share their weight tensor, per shared weight (two or more).

    Unquantized embeddings only: their processing just repacks and can run again safely.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            holders.setdefault(id(weight), []).append(module)
    return [modules for modules in holders.values() if len(modules) >= 2]
