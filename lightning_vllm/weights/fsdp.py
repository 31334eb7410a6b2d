"""The weights of a model wrapped in FSDP (FSDP1, ``FullyShardedDataParallel``), one unit at a time.

Each FSDP unit (the root, and every wrapped sub-module such as a decoder layer)
keeps its parameters flattened and sharded, so ``named_parameters()`` shows each rank
a 1-D slice. The full names and shapes are read from each unit's flat parameter
(no gather), and a unit is gathered with ``FSDP.summon_full_params(unit,
recurse=False, writeback=False)`` only while its tensors are read: a collective,
so every rank must walk the units in the same order (``fronts/lightning/roles.LockstepWeights``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import canonical_name, find_hf_model


class FSDPWeights(Weights):
    """The parameters of an FSDP1-wrapped model under their checkpoint names, gathered unit by unit.

    Args:
        module: the FSDP root (or a module holding FSDP units that together own every
            parameter), wrapping a Hugging Face model or a LightningModule that holds one
            (as Lightning's ``FSDPStrategy`` wraps it).
        model_attribute: the LightningModule attribute holding the model, if not found automatically.

    Raises:
        ValueError: a parameter of ``module`` belongs to no FSDP unit.
    """

    def __init__(self, module: torch.nn.Module, model_attribute: str | None = None) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as fsdp

        model_prefix = _model_prefix(module, model_attribute)
        self.units: list[tuple[Any, list[tuple[str, str]]]] = []  # (unit, [(local name, checkpoint name)])
        self._meta: list[ParamMeta] = []
        for prefix, unit in module.named_modules():
            handle = getattr(unit, "_handle", None) if isinstance(unit, fsdp) else None
            if handle is None:  # a unit with no parameters of its own
                continue
            flat = handle.flat_param
            names = []
            for local, shape in zip(flat._fqns, flat._shapes):
                name = canonical_name(f"{prefix}.{local}" if prefix else local).removeprefix(model_prefix)
                names.append((local, name))
                self._meta.append(ParamMeta(name, flat.dtype, tuple(shape)))
            self.units.append((unit, names))
        from torch.distributed.fsdp._flat_param import FlatParameter

        owned = {meta.name for meta in self._meta}
        orphans = [
            name
            for name, param in module.named_parameters()
            if not isinstance(param, FlatParameter) and canonical_name(name).removeprefix(model_prefix) not in owned
        ]
        if not self._meta or orphans:
            raise ValueError(
                f"{type(module).__name__} has parameters outside any FSDP unit ({', '.join(orphans[:3])}); "
                "pass the FSDP root (the outermost FullyShardedDataParallel)."
            )

    def declare(self) -> list[ParamMeta]:
        return list(self._meta)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.fsdp import FullyShardedDataParallel as fsdp

        for unit, names in self.units:
            inner = unit.module  # the wrapped module, whose parameters are full inside the context
            with fsdp.summon_full_params(unit, recurse=False, writeback=False):
                for local, name in names:
                    # The full tensor lives only inside the context; the transfer may read it later.
                    yield name, _attribute(inner, local).detach().clone()


def _attribute(module: torch.nn.Module, dotted: str) -> torch.Tensor:
    # Not get_parameter: without use_orig_params, FSDP exposes the full tensors as plain attributes.
    path, _, leaf = dotted.rpartition(".")
    return getattr(module.get_submodule(path) if path else module, leaf)


def _model_prefix(module: torch.nn.Module, model_attribute: str | None) -> str:
    """``"model."`` when ``module`` wraps a LightningModule holding the Hugging Face model as ``self.model``."""
    from lightning.pytorch import LightningModule

    inner = getattr(module, "module", module)  # FSDP's wrapped module
    if not isinstance(inner, LightningModule):
        return ""
    if model_attribute is not None:
        return f"{model_attribute}."
    model = find_hf_model(inner)
    path = next(name for name, child in inner.named_modules() if child is model)
    # canonical_name cleans tensor names: give the path one, so its wrapper segments go too.
    return canonical_name(f"{path}.weight").removesuffix("weight")
