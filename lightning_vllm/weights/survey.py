"""What kind of weights a module tree holds, found in one walk: FSDP1 units, PEFT LoRA layers, ZeRO-3 partitions.

Which source reads a policy (``sources.weights_from``), and whether its LoRA adapter could go alone
(``lora.adapter.lora_policy``), depend on three questions about the module tree. Asked one by one,
each walked the tree, and ``isinstance`` against PEFT's ``LoraLayer`` (an ABC) is slow: on an 8B
model's ~420 modules the questions of one push cost about 2 ms of trainer Python, a fifth of the
copy a colocated push makes (docs/gpu.md). :func:`survey` answers the three in one walk, checking
each module *type* once, and lists the parameters on the way (``ModuleWeights`` sends them); a push
keeps its surveys in a :class:`Surveys`, so that each module is walked once.
"""

from __future__ import annotations

import weakref
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
        shape: the tree as found, held weakly, to tell later whether it is still so (:class:`TreeShape`).
    """

    fsdp_units: bool
    lora_layers: bool
    zero3_parameters: bool
    parameters: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list, repr=False, compare=False)
    shape: TreeShape | None = field(default=None, repr=False, compare=False)


class TreeShape:
    """A module tree as a survey found it: each module with its children and its parameters by name, each the very
    object found (held weakly: this keeps nothing alive), a parameter with its dtype and shape.

    :meth:`holds` tells, without walking the tree again, whether it is still exactly so: no module or parameter
    added, removed or replaced, by ``setattr`` or in the modules' dicts directly, and no parameter's data swapped
    for another dtype or shape. An 8B model's check costs about a tenth of its survey (docs/gpu.md).
    """

    def __init__(self) -> None:
        # (module, its children by name, its parameters by name with their dtypes and shapes)
        self._modules: list[tuple[weakref.ref, list[tuple[str, Any]], list[tuple[str, Any, Any, Any]]]] = []

    def add(self, module: torch.nn.Module) -> None:
        children = [(name, _weak(child)) for name, child in module._modules.items()]
        parameters = [
            (name, _weak(param), None if param is None else param.dtype, None if param is None else param.shape)
            for name, param in module._parameters.items()
        ]
        self._modules.append((weakref.ref(module), children, parameters))

    def holds(self) -> bool:
        """Whether every module, child and parameter is still the one found, each parameter of the same dtype and
        shape, and none was added."""
        for module_ref, children, parameters in self._modules:
            module = module_ref()
            if module is None or len(module._modules) != len(children) or len(module._parameters) != len(parameters):
                return False
            for name, child in children:
                if module._modules.get(name, _MISSING) is not _strong(child):
                    return False
            for name, param_ref, dtype, shape in parameters:
                param = module._parameters.get(name, _MISSING)
                if param is not _strong(param_ref) or (
                    param is not None and (param.dtype != dtype or param.shape != shape)
                ):
                    return False
        return True


_MISSING = object()


def _weak(value: Any) -> Any:
    return None if value is None else weakref.ref(value)


def _strong(reference: Any) -> Any:
    return None if reference is None else reference()


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
    shape = TreeShape()
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
        shape.add(current)
        kinds |= _kind(type(current))
        for name, param in current._parameters.items():
            if param is None or id(param) in seen_parameters:
                continue
            seen_parameters.add(id(param))
            parameters.append((prefix + name, param))
            zero3 = zero3 or hasattr(param, "ds_id")
        children = [(f"{prefix}{name}.", child) for name, child in current._modules.items() if child is not None]
        stack.extend(reversed(children))
    return Survey(bool(kinds & _FSDP_UNIT), bool(kinds & _LORA_LAYER), zero3, parameters, shape)
