"""A PEFT LoRA policy sent as its adapter: what is sent (whether an engine can serve it: ``serving.py``).

vLLM serves LoRA adapters beside the base model (``enable_lora=True``). When the
policy is a PEFT LoRA model whose base weights stay frozen, a push needs to move
only the adapter's ``lora_A``/``lora_B`` tensors (about 1 % of a 7B model at rank
16) and its config, instead of merged full weights. The engine must start from the
policy's base weights, so the first push of each connection sends them once, with
the adapter, in the same atomic update (:class:`WithAdapter`).

Names follow PEFT's saved adapters (``base_model.model.<module>.lora_A.weight``),
which is what vLLM's LoRA loader parses. vLLM's own ``PEFTHelper`` judges the config
(rank, DoRA, bias, ...), so trainer and engine apply the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, materialize_full_tensor

from lightning_vllm.in_vllm.lora_adapters import ADAPTER_PREFIX
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import canonical_name
from lightning_vllm.weights.survey import Survey, survey

# Config fields vLLM's PEFTHelper reads; the rest of a PEFT config (paths, init
# options that only matter before training) is left out of the message.
_CONFIG_FIELDS = (
    "r", "lora_alpha", "target_modules", "bias", "modules_to_save", "use_rslora", "use_dora", "lora_bias",
    "init_lora_weights", "alora_invocation_tokens", "layer_replication", "use_qalora", "rank_pattern",
    "alpha_pattern",
)  # fmt: skip


def lora_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(checkpoint name of the adapted module, PEFT LoRA layer)`` for every LoRA layer."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [
        (canonical_name(f"{name}.weight").removesuffix(".weight"), layer)
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer)
    ]


def active_adapter(module: torch.nn.Module) -> str:
    """The name of the single active adapter of a PEFT model.

    Raises:
        ValueError: several adapters are active (vLLM serves one per request).
    """
    active = getattr(module, "active_adapters", None)
    names = list(active() if callable(active) else active or ["default"])
    if len(names) != 1:
        raise ValueError(f"{len(names)} adapters are active ({names}); an adapter push sends exactly one.")
    return str(names[0])


def adapter_config(module: torch.nn.Module) -> dict[str, Any]:
    """The active adapter's PEFT config as plain JSON values (what vLLM's ``PEFTHelper`` reads)."""
    config = module.peft_config[active_adapter(module)].to_dict()  # type: ignore[index, union-attr, operator]
    plain = {}
    for key in _CONFIG_FIELDS:
        value = config.get(key)
        plain[key] = sorted(value) if isinstance(value, (set, frozenset)) else value
    return plain


class AdapterWeights(Weights):
    """The active adapter's ``lora_A``/``lora_B`` tensors, named as in a saved PEFT adapter.

    ``adapter_config`` travels with them (vLLM needs rank, alpha and target modules).
    Sharded (FSDP2) adapter tensors are gathered one at a time, in the same order on every rank.

    Example::

        >>> from peft import LoraConfig, get_peft_model  # doctest: +SKIP
        >>> peft = get_peft_model(hf_model, LoraConfig(r=8, target_modules=["q_proj"]))  # doctest: +SKIP
        >>> next(iter(AdapterWeights(peft)))[0]  # doctest: +SKIP
        'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.adapter_config = adapter_config(module)
        name = active_adapter(module)
        self._params: list[tuple[str, torch.Tensor]] = []
        for layer_name, layer in lora_layers(module):
            if name in layer.lora_A:
                self._params.append((f"{ADAPTER_PREFIX}{layer_name}.lora_A.weight", layer.lora_A[name].weight))
                self._params.append((f"{ADAPTER_PREFIX}{layer_name}.lora_B.weight", layer.lora_B[name].weight))
        if not self._params:
            raise ValueError(f"The model has no LoRA layer for its active adapter {name!r}.")

    def declare(self) -> list[ParamMeta]:
        return [ParamMeta(name, param.dtype, tuple(param.shape)) for name, param in self._params]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._params:  # (no grad mode held across a yield: see weights/lora_merge.py)
            with torch.no_grad():
                tensor = materialize_full_tensor(param.detach())
            yield name, tensor


class WithAdapter(Weights):
    """The policy's base weights, then its adapter: the first push of a connection.

    The engine loads both in one update, so it never serves the adapter on other base weights.
    """

    def __init__(self, base: Weights, adapter: AdapterWeights) -> None:
        self.base = base
        self.adapter = adapter

    def declare(self) -> list[ParamMeta]:
        return [*self.base.metadata, *self.adapter.metadata]

    def groups(self) -> list[list[str]]:
        # vLLM's layer-wise grouping would interleave the two by layer index; keep them apart.
        return [*self.base.groups(), *self.adapter.groups()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.base.iter_full()
        yield from self.adapter.iter_full()


NOT_A_LORA_POLICY = (
    "lora='adapter' needs a PEFT LoRA policy (a PeftModel with LoRA layers), plain, under DDP or "
    "sharded with FSDP2; FSDP1 and ZeRO-3 policies are sent merged (lora='merged')."
)


def lora_policy(
    weights: Any, model_attribute: str | None = None, surveys: Callable[[torch.nn.Module], Survey] = survey
) -> torch.nn.Module | None:
    """The PEFT LoRA model inside ``weights`` whose adapter can be sent alone, else ``None``.

    That is a PEFT model with LoRA layers, plain, under DDP or sharded with FSDP2;
    FSDP1 and ZeRO-3 wrappers are sent merged. ``surveys``: how a module is surveyed (a push's
    :class:`~lightning_vllm.weights.survey.Surveys` walks each module once).
    """
    from lightning_vllm.weights.model import find_hf_model

    if not isinstance(weights, torch.nn.Module) or surveys(weights).fsdp_units:
        return None
    try:
        model = find_hf_model(weights, model_attribute)
    except ValueError:
        return None
    found = surveys(model)
    if not found.lora_layers or found.zero3_parameters or not hasattr(model, "peft_config"):
        return None
    return model


def adapter_source(model: torch.nn.Module, with_base: bool) -> tuple[Weights, dict[str, Any]]:
    """What an adapter push of ``model`` sends (its adapter, after its base weights if ``with_base``),
    and the adapter's config."""
    from lightning_vllm.weights.checkpoint_layout import in_checkpoint_layout
    from lightning_vllm.weights.sources import LoraBaseWeights

    adapter = AdapterWeights(model)
    # (The base in its checkpoint's layout, as vLLM loads it: a MoE policy's experts one by one.)
    source = WithAdapter(in_checkpoint_layout(LoraBaseWeights(model), model), adapter) if with_base else adapter
    return source, adapter.adapter_config


def adapter_metadata(
    engine_metadata: Mapping[str, tuple[torch.dtype, Any]], source: Weights, lora_dtype: torch.dtype | None
) -> dict[str, tuple[torch.dtype, Any]]:
    """What a push of ``source`` (an adapter, or base weights then adapter) sends an engine
    that loads ``engine_metadata``: its base weights as the engine loads them, and the adapter's tensors in the
    engine's ``lora_dtype``, else in the dtype of the weights they adapt."""
    adapter = {meta.name: meta for meta in source.metadata if meta.name.startswith(ADAPTER_PREFIX)}
    sent = dict(engine_metadata) if len(adapter) < len(source.metadata) else {}
    for name, meta in adapter.items():
        adapted = name.removeprefix(ADAPTER_PREFIX).rsplit(".", 2)[0] + ".weight"
        dtype = lora_dtype or engine_metadata.get(adapted, (meta.dtype,))[0]
        sent[name] = (dtype, torch.Size(meta.shape))
    return sent
