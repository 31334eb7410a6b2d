"""PEFT LoRA models: send the merged weights without merging the live model.

vLLM serves the base architecture, so a LoRA policy is sent as base weight plus
the adapters' delta, under the base model's names. The merge happens one
parameter at a time into a fresh tensor (``get_delta_weight`` builds the delta
without touching the module), so the training module is never changed and the
extra memory is one weight matrix, not a merged copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import materialize_full_tensor

# Parameters that belong to adapters, or to the frozen copy PEFT keeps beside a
# trained module (modules_to_save): never sent.
_ADAPTER_MARKERS = (
    ".lora_A.",
    ".lora_B.",
    ".lora_embedding_A.",
    ".lora_embedding_B.",
    ".lora_magnitude_vector.",
    ".original_module.",
)
_BASE_SUFFIX = ".base_layer.weight"
_SAVED_MODULE = ".modules_to_save."


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an adapter (or to the frozen copy PEFT keeps beside a
    trained module), so that merged weights never include it as such."""
    return any(marker in name for marker in _ADAPTER_MARKERS)


def _sent_name(name: str) -> str | None:
    """The name under which ``name`` is sent, or ``None`` for adapter parameters."""
    if is_adapter_parameter(name):
        return None
    if _SAVED_MODULE in name:  # "lm_head.modules_to_save.default.weight" -> "lm_head.weight"
        head, _, tail = name.partition(_SAVED_MODULE)
        return f"{head}.{tail.partition('.')[2]}"
    return name


def lora_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of what is sent for a LoRA model: base and trained weights, no adapters."""
    for name, param in module.named_parameters():
        sent = _sent_name(name)
        if sent is not None:
            yield sent, param


def _adapters_merged_into(module: torch.nn.Module, name: str) -> tuple[Any, list[str]]:
    """The LoRA layer whose base weight is ``name`` and its adapters that a merge adds to it
    (``None`` and none for other parameters, and for layers merged into the weight or disabled)."""
    from peft.tuners.lora import LoraLayer

    if not name.endswith(_BASE_SUFFIX):
        return None, []
    layer = module.get_submodule(name[: -len(_BASE_SUFFIX)])
    if not isinstance(layer, LoraLayer) or layer.merged or layer.disable_adapters:
        return None, []
    return layer, [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]


def merge_inputs(module: torch.nn.Module, name: str) -> list[torch.Tensor]:
    """The adapter tensors :func:`merged_lora_weights` adds to the base weight ``name``."""
    layer, adapters = _adapters_merged_into(module, name)
    return [
        cast(torch.Tensor, factor[adapter].weight) for adapter in adapters for factor in (layer.lora_A, layer.lora_B)
    ]


def merged_lora_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Like :func:`lora_parameters`, with each LoRA base weight replaced by base + active adapters' delta."""
    # Grad mode is per thread, and a generator suspended inside `torch.no_grad()` would leave it off
    # for its consumer (and for training, if a consumer stops early): each merge gets its own block.
    for name, param in lora_parameters(module):
        layer, adapters = _adapters_merged_into(module, name)
        with torch.no_grad():
            tensor = materialize_full_tensor(param.detach())
            # Under FSDP2 the adapters are DTensors too: their product is one, gathered here
            # (a collective, in the same order on every rank).
            deltas = [materialize_full_tensor(layer.get_delta_weight(adapter)) for adapter in adapters]
            if deltas:
                tensor = tensor + sum(deltas[1:], deltas[0]).to(tensor.dtype)
        yield name, tensor
