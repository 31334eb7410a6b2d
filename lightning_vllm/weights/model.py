"""Finding the Hugging Face model and naming its weights as vLLM's loader expects.

vLLM loads weights by their Hugging Face checkpoint names (``model.layers.0...``,
``lm_head.weight``). Wrappers add prefixes that no checkpoint has: the
LightningModule attribute, ``_orig_mod.`` from ``torch.compile``, ``module.`` from
DDP, ``base_model.model.`` and ``.base_layer`` from PEFT. They are removed here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

ModelMetadata = dict[str, tuple[torch.dtype, torch.Size]]
"""``{parameter name: (dtype, shape)}``, the form TorchRL's ``vLLMUpdater`` uses."""


def as_metadata(metadata: Mapping[str, tuple[torch.dtype, Any]] | None) -> ModelMetadata | None:
    """``{name: (dtype, shape)}`` with every shape a ``torch.Size`` (``None`` stays ``None``)."""
    if metadata is None:
        return None
    return {name: (dtype, torch.Size(shape)) for name, (dtype, shape) in metadata.items()}


# Segments that wrappers insert into parameter names; none is part of a checkpoint name.
_WRAPPER_SEGMENT = re.compile(r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module|base_layer)(?=\.)")
_WRAPPER_PREFIXES = ("module.", "base_model.model.")


def canonical_name(name: str) -> str:
    """The checkpoint name of a parameter, without wrapper segments.

    Example::

        >>> canonical_name("_orig_mod.model.layers.0.self_attn.q_proj.base_layer.weight")
        'model.layers.0.self_attn.q_proj.weight'
        >>> canonical_name("module.lm_head.weight")
        'lm_head.weight'
    """
    found = _canonical_names.get(name)
    if found is None:  # (a push names every tensor: on an 8B model, 291 regexes took 0.2 ms each push)
        if len(_canonical_names) > _MAX_REMEMBERED_NAMES:
            _canonical_names.clear()
        found = _canonical_names[name] = _without_wrappers(name)
    return found


_canonical_names: dict[str, str] = {}
_MAX_REMEMBERED_NAMES = 1 << 17


def _without_wrappers(name: str) -> str:
    name = _WRAPPER_SEGMENT.sub("", name).lstrip(".")
    while prefix := next((prefix for prefix in _WRAPPER_PREFIXES if name.startswith(prefix)), None):
        name = name.removeprefix(prefix)
    return name


def repeated_names(names: Iterable[str]) -> list[str]:
    """The names that occur more than once, sorted.

    Example::

        >>> repeated_names(["a", "b", "a", "c", "b"])
        ['a', 'b']
    """
    seen: set[str] = set()
    return sorted({name for name in names if name in seen or seen.add(name)})  # type: ignore[func-returns-value]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Remove ``torch.compile``, DDP and DeepSpeed-engine wrappers around a module."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        # DeepSpeed's engine, matched by name: deepspeed is imported only where it is used.
        wrapper = (
            isinstance(module, torch.nn.parallel.DistributedDataParallel) or type(module).__name__ == "DeepSpeedEngine"
        )
        if inner is None and wrapper:
            inner = module.module
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _is_hf_model(module: torch.nn.Module) -> bool:
    if isinstance(module, PreTrainedModel):
        return True
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def find_hf_model(module: torch.nn.Module, attribute: str | None = None) -> torch.nn.Module:
    """The Hugging Face model (or PEFT model) whose weights vLLM serves.

    Args:
        module: a ``PreTrainedModel``, a PEFT model, a LightningModule holding one, or any module.
        attribute: the LightningModule attribute holding the model (e.g. ``"model"``);
            found automatically when ``None``.

    Returns:
        The model, without ``torch.compile`` or DDP wrappers.

    Raises:
        ValueError: the attribute is missing, or there is no single Hugging Face model.

    Example::

        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> hf = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=1, num_key_value_heads=1, vocab_size=32))
        >>> class Policy(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.policy = torch.compile(hf, backend="eager")
        >>> find_hf_model(Policy()) is hf
        True
    """
    if attribute is not None:
        found = getattr(module, attribute, None)
        if not isinstance(found, torch.nn.Module):
            raise ValueError(
                f"{type(module).__name__} has no module attribute {attribute!r}; pass the name of the attribute "
                "that holds the Hugging Face model (model_attribute=...)."
            )
        return unwrap(found)
    # Imported here: vLLM imports this module in each of its processes (through the transport
    # plugin), which never hold a LightningModule and need not load Lightning.
    from lightning.pytorch import LightningModule

    module = unwrap(module)
    if not isinstance(module, LightningModule):
        return module
    candidates = [name for name, child in module.named_modules() if name and _is_hf_model(child)]
    # A Hugging Face model nested in another one (Qwen2ForCausalLM.model, PeftModel.base_model) is part of it.
    outermost = [name for name in candidates if not any(name.startswith(other + ".") for other in candidates)]
    if len(outermost) == 1:
        return module.get_submodule(outermost[0])
    if not outermost:
        raise ValueError(
            f"{type(module).__name__} holds no Hugging Face PreTrainedModel; keep the policy as an attribute "
            "(e.g. self.model = AutoModelForCausalLM...) or name it with model_attribute=..."
        )
    raise ValueError(
        f"{type(module).__name__} holds several Hugging Face models ({', '.join(outermost)}); "
        "say which one vLLM serves with model_attribute=..."
    )


def metadata_bytes(metadata: ModelMetadata) -> int:
    """The bytes of the tensors ``metadata`` describes."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in metadata.values())


def smallest_group(groups: list[list[str]], metadata: ModelMetadata) -> list[str]:
    """The group of names of ``groups`` whose tensors in ``metadata`` take the fewest bytes."""
    return min(groups, key=lambda group: metadata_bytes({name: metadata[name] for name in group}))
