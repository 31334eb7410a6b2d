"""How an engine serves a pushed LoRA adapter: its LoRA settings, whether it can serve a policy's
adapter (and so how the policy is sent), and the adapter it generates through.

The engine targets (``engines/``) and the server middleware (``server.py``) read these;
nothing here imports either, so both can.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lightning_vllm.errors import EngineConfigError
from lightning_vllm.in_vllm.lora_adapters import adapter_directory
from lightning_vllm.lora.adapter import active_adapter, adapter_config, lora_layers
from lightning_vllm.options import LoraMode
from lightning_vllm.weights.checks import ExpectedWeights
from lightning_vllm.weights.lora_merge import is_adapter_parameter
from lightning_vllm.weights.model import canonical_name
from lightning_vllm.weights.payload import PushView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraLimits:
    """An engine's LoRA settings (``enable_lora=True`` and its options).

    Attributes:
        max_lora_rank: the largest adapter rank the engine accepts.
        max_loras: adapters one batch may use at once (the policy's adapter takes one).
        lora_dtype: the dtype the engine keeps adapters in; ``None`` for the serving dtype.
        target_modules: the modules the engine restricts LoRA to, ``None`` for all it supports.
    """

    max_lora_rank: int
    max_loras: int
    lora_dtype: torch.dtype | None = None
    target_modules: tuple[str, ...] | None = None


def lora_limits_from(lora_config: Any) -> LoraLimits | None:
    """An engine's :class:`LoraLimits` from vLLM's ``LoRAConfig`` (an object, or a dict from ``/server_info``)."""
    if not lora_config:
        return None
    read = lora_config.get if isinstance(lora_config, dict) else lambda key: getattr(lora_config, key, None)
    dtype = read("lora_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    targets = read("target_modules")
    return LoraLimits(
        max_lora_rank=int(read("max_lora_rank") or 0),
        max_loras=int(read("max_loras") or 1),
        lora_dtype=dtype if isinstance(dtype, torch.dtype) else None,
        target_modules=tuple(targets) if targets else None,
    )


@dataclass(frozen=True)
class PolicyAdapter:
    """The LoRA adapter through which an engine serves the policy after adapter pushes.

    Every adapter push replaces it in place (same name, id and directory), as a full
    push replaces the weights; requests through :meth:`lora_request` (or, on a server,
    with this ``name`` as the model) sample from the adapter of the last commit. The
    workers stage it in :func:`adapter_directory` of ``key`` on the engine's host.

    Example::

        >>> PolicyAdapter(key="0123abcd").lora_request().lora_name
        'lightning-vllm-policy'
    """

    key: str
    name: str = "lightning-vllm-policy"
    lora_id: int = 1 << 30  # far from the small ids vLLM's server hands out to its own adapters

    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` to generate with; made on the engine's host."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, adapter_directory(self.key))

    def message(self, config: dict[str, Any]) -> dict[str, Any]:
        """What an update carrying this adapter tells the workers."""
        return {"key": self.key, "config": config}


def adapter_problems(
    module: torch.nn.Module, limits: LoraLimits | None, expected: ExpectedWeights | None, engine: str
) -> list[str]:
    """Why ``engine`` cannot serve ``module``'s adapter as a LoRA (empty when it can).

    Read from the trainer's model and the engine's settings before anything is sent;
    the engine's workers check the modules again, exactly, before they load anything.
    """
    if limits is None:
        return [
            f"the {engine} engine was built without LoRA: build it with enable_lora=True and max_lora_rank "
            "at least the adapter's rank"
        ]
    from vllm.lora.peft_helper import PEFTHelper

    problems: list[str] = []
    try:
        name = active_adapter(module)
        PEFTHelper.from_dict(adapter_config(module)).validate_legal(limits)  # type: ignore[arg-type]
    except ValueError as error:  # vLLM's own rules: rank, DoRA, bias, modules_to_save, ...
        return [f"vLLM refuses the adapter: {error}"]
    for layer_name, layer in lora_layers(module):
        if name not in layer.lora_A and name not in getattr(layer, "lora_embedding_A", {}):
            continue
        leaf = layer_name.rsplit(".", 1)[-1]
        if not isinstance(layer.get_base_layer(), torch.nn.Linear):
            problems.append(f"{layer_name} is a {type(layer.get_base_layer()).__name__}; vLLM adapts linear layers")
        elif expected is not None and f"{layer_name}.weight" not in expected.weights:
            problems.append(f"{layer_name} is not a linear layer the engine's model loads")
        elif layer_name.endswith("lm_head"):
            problems.append("vLLM does not serve LoRA on lm_head")
        elif limits.target_modules is not None and leaf not in limits.target_modules:
            problems.append(f"the engine limits LoRA to {list(limits.target_modules)}, not {leaf}")
    frozen_changes = [
        canonical_name(param_name)
        for param_name, param in module.named_parameters()
        if param.requires_grad and not is_adapter_parameter(param_name)
    ]
    if frozen_changes:
        problems.append(
            f"{len(frozen_changes)} parameter(s) outside the adapter are trained (e.g. {frozen_changes[0]}), "
            "and a LoRA cannot carry them"
        )
    return problems


def choose_view_of_problems(lora: LoraMode, problems: list[str], engines_have_base: bool) -> PushView:
    """How a LoRA policy is sent: ``"merged"``, ``"adapter"`` or ``"base_and_adapter"``.

    Args:
        lora: the updater's mode (not ``"merged"``).
        problems: why some engine cannot serve the adapter (see :func:`adapter_problems`).
        engines_have_base: whether every engine already has the policy's base weights.

    Raises:
        EngineConfigError: ``lora="adapter"`` and there are problems (listed in the message).

    Example::

        >>> choose_view_of_problems("auto", ["no LoRA"], engines_have_base=False)
        'merged'
    """
    if problems:
        if lora == "adapter":
            raise EngineConfigError(
                f"lora='adapter' but the adapter cannot be served: {'; '.join(problems)}. Fix that, or pass "
                "lora='merged' (or 'auto', which then sends merged weights)."
            )
        log.info("Pushing merged LoRA weights, not the adapter alone: %s", "; ".join(problems))
        return "merged"
    return "adapter" if engines_have_base else "base_and_adapter"
