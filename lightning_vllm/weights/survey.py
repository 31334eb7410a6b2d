"""What kind of weights a module tree holds, found in one walk: FSDP1 units, PEFT LoRA layers, ZeRO-3 partitions.

Which source reads a policy (``sources.weights_from``), and whether its LoRA adapter could go alone
(``lora.adapter.lora_policy``), depend on three questions about the module tree. Asked one by one,
each walked the tree, and ``isinstance`` against PEFT's ``LoraLayer`` (an ABC) is slow: on an 8B
model's ~420 modules the questions of one push cost about 2 ms of trainer Python, a fifth of the
copy a colocated push makes (docs/runs.md). :func:`survey` answers the three in one walk, checking
each module *type* once, and lists the parameters on the way (``ModuleWeights`` sends them); a push
keeps its surveys in a :class:`Surveys`, so that each module is walked once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Survey:
    """What one walk over a module tree found.

    Attributes:
        fsdp_units: an FSDP1 unit (``FullyShardedDataParallel``) is inside, or is the module.
        lora_layers: a PEFT LoRA layer is inside.
        zero3_parameters: a parameter partitioned by ZeRO-3 (it carries a ``ds_id``) is inside.
        parameters: ``module.named_parameters()``, in its order.
        modules: every module of the tree, each once, in the walk's order (a push keeps the tree's shape from them:
            ``payload.TreeShape``).
    """

    fsdp_units: bool
    lora_layers: bool
    zero3_parameters: bool
    parameters: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list, repr=False, compare=False)
    modules: list[torch.nn.Module] = field(default_factory=list, repr=False, compare=False)


class Surveys:
    """The surveys of one push: each module walked once, however many questions the push asks of it.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> surveys = Surveys()
        >>> surveys(net) is surveys(net)
        True
    """

    def __init__(self) -> None:
        self._found: dict[int, tuple[torch.nn.Module, Survey]] = {}

    def __call__(self, module: torch.nn.Module) -> Survey:
        found = self._found.get(id(module))
        if found is None or found[0] is not module:
            found = self._found[id(module)] = (module, survey(module))
        return found[1]

    def made(self, module: Any) -> Survey | None:
        """The survey of ``module`` made so far, if any (none is made here)."""
        found = self._found.get(id(module))
        return found[1] if found is not None and found[0] is module else None


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
    """What kind of weights ``module`` holds, and its named parameters, in one walk over its modules.

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> survey(net)
        Survey(fsdp_units=False, lora_layers=False, zero3_parameters=False)
        >>> [name for name, _ in survey(net).parameters]
        ['0.weight', '0.bias']
    """
    kinds = 0
    zero3 = False
    parameters: list[tuple[str, torch.nn.Parameter]] = []
    modules: list[torch.nn.Module] = []
    seen_modules: set[int] = set()
    seen_parameters: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    # named_parameters()'s order and sharing rules (pre-order, each module and each parameter once), its names
    # built once per module.
    while stack:
        prefix, current = stack.pop()
        if id(current) in seen_modules:
            continue
        seen_modules.add(id(current))
        modules.append(current)
        kinds |= _kind(type(current))
        for name, param in current._parameters.items():
            if param is None or id(param) in seen_parameters:
                continue
            seen_parameters.add(id(param))
            parameters.append((prefix + name, param))
            zero3 = zero3 or hasattr(param, "ds_id")
        children = [(f"{prefix}{name}.", child) for name, child in current._modules.items() if child is not None]
        stack.extend(reversed(children))
    return Survey(bool(kinds & _FSDP_UNIT), bool(kinds & _LORA_LAYER), zero3, parameters, modules)
