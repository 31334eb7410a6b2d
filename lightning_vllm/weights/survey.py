"""What kind of weights a module tree holds, found in one walk: FSDP1 units, PEFT LoRA layers, ZeRO-3 partitions.

Which source reads a policy (``sources.weights_from``), and whether its LoRA adapter could go alone
(``lora.adapter.lora_policy``), depend on three questions about the module tree. Asked one by one,
each walked the tree, and ``isinstance`` against PEFT's ``LoraLayer`` (an ABC) is slow: on an 8B
model's ~420 modules the questions of one push cost about 2 ms of trainer Python, a fifth of the
copy a colocated push makes (docs/gpu.md). :func:`survey` answers the three in one walk, checking
each module *type* once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_vllm.weights.model import submodules


@dataclass(frozen=True)
class Survey:
    """What one walk over a module tree found.

    Attributes:
        fsdp_units: an FSDP1 unit (``FullyShardedDataParallel``) is inside, or is the module.
        lora_layers: a PEFT LoRA layer is inside.
        zero3_parameters: a parameter partitioned by ZeRO-3 (it carries a ``ds_id``) is inside.
    """

    fsdp_units: bool
    lora_layers: bool
    zero3_parameters: bool


_FSDP_UNIT, _LORA_LAYER = 1, 2
_kinds: dict[type, int] = {}  # module type -> what it is, asked once per type


def _kind(module_type: type) -> int:
    kind = _kinds.get(module_type)
    if kind is None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kind = _FSDP_UNIT if issubclass(module_type, FullyShardedDataParallel) else 0
        lora_layer = _lora_layer_class()
        if lora_layer is not None and issubclass(module_type, lora_layer):
            kind |= _LORA_LAYER
        _kinds[module_type] = kind
    return kind


def _lora_layer_class() -> Any:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return None
    return LoraLayer


def survey(module: torch.nn.Module) -> Survey:
    """What kind of weights ``module`` holds, in one walk over its modules.

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> survey(net)
        Survey(fsdp_units=False, lora_layers=False, zero3_parameters=False)
    """
    kinds = 0
    zero3 = False
    for child in submodules(module):
        kinds |= _kind(type(child))
        if not zero3:
            zero3 = any(hasattr(param, "ds_id") for param in child._parameters.values() if param is not None)
    return Survey(bool(kinds & _FSDP_UNIT), bool(kinds & _LORA_LAYER), zero3)
