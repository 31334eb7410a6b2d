"""How an engine serves a pushed LoRA adapter: its LoRA settings, and the adapter it generates through.

The engine targets (``engines/``) and the server middleware (``server.py``) read these;
nothing here imports either, so both can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_vllm.lora.worker import adapter_directory


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
