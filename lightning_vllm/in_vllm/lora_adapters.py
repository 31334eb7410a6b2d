"""Inside a vLLM worker: a received LoRA adapter, checked, then staged where vLLM's LoRA loader finds it.

vLLM serves adapters through ``LoRARequest(name, id, path)`` and loads them from
that path in each worker, lazily, at the first step that uses them. It also drops
every loaded adapter after each weight update (``reset_lora_state``, since adapters
computed against old base weights are stale), so an adapter handed to the LoRA
manager in memory would be gone before its first request. The adapter's tensors
therefore arrive over the transport (no file shared with the trainer) and each
worker writes them into a directory of its own host, RAM-backed (``/dev/shm``) by
default, as a PEFT adapter; vLLM then loads it there with its own loader and
checks. The directory is chosen on the engine's host (``LIGHTNING_VLLM_ADAPTER_DIR``
overrides the default): the trainer only names it with a key.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

ADAPTER_PREFIX = "base_model.model."
"""What an adapter's tensors are named under when they travel beside the base weights (PEFT's names)."""
ADAPTER_DIR_VARIABLE = "LIGHTNING_VLLM_ADAPTER_DIR"
_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def adapter_directory(key: str) -> str:
    """Where the engine on this host keeps the adapter staged under ``key``.

    Read on the engine's host: by its workers, which write there, and wherever its
    requests are made (an in-process engine, a Ray actor, a server's middleware).

    Example::

        >>> adapter_directory("policy-1").endswith("lightning-vllm/policy-1")
        True
    """
    if not _KEY.match(key):
        raise ValueError(f"An adapter key must be 1 to 64 letters, digits, '-' or '_', got {key!r}.")
    base = os.environ.get(ADAPTER_DIR_VARIABLE)
    if not base:
        shm = Path("/dev/shm")
        base = str(shm / "lightning-vllm") if shm.is_dir() else str(Path(tempfile.gettempdir()) / "lightning-vllm")
    return str(Path(base) / key)


class ReceivedAdapter:
    """A LoRA adapter received by a worker, checked against the engine before anything is written or loaded.

    Args:
        model: the worker's model (vLLM attaches ``lora_manager`` to it when LoRA is enabled).
        vllm_config: the engine's config.
        message: ``{"key", "config"}`` from the update (see ``PolicyAdapter.message``).
        tensors: the adapter's tensors by PEFT name (``base_model.model.<module>.lora_A.weight``).

    Raises:
        ValueError: the engine has no LoRA, or vLLM refuses the adapter (rank above
            ``max_lora_rank``, a module it cannot adapt, DoRA, ...); the message says which.
    """

    def __init__(
        self, model: torch.nn.Module, vllm_config: Any, message: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> None:
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager = getattr(model, "lora_manager", None)
        if manager is None or vllm_config.lora_config is None:
            raise ValueError(
                "This vLLM engine was built without LoRA, so it cannot serve an adapter: build it with "
                "enable_lora=True (and max_lora_rank >= the adapter's rank), or push merged weights (lora='merged')."
            )
        self.directory = Path(adapter_directory(str(message["key"])))
        self.config = dict(message["config"])
        # vLLM's own rules, as its loader will apply them: a refusal there would fail a request.
        PEFTHelper.from_dict(self.config).validate_legal(vllm_config.lora_config)
        supported: set[str] = set()
        for module in manager.supported_lora_modules:
            supported.update(manager.packed_modules_mapping.get(module, [module]))
        adapted = {parse_fine_tuned_lora_name(name)[0] for name in tensors}
        unsupported = sorted(name for name in adapted if name.rsplit(".", 1)[-1] not in supported)
        if unsupported:
            raise ValueError(
                f"vLLM cannot serve LoRA on {unsupported[:5]} in this model: it adapts {sorted(supported)}. "
                "Target those modules only, or push merged weights (lora='merged')."
            )
        self.tensors = tensors

    def save(self) -> None:
        """Write the adapter as PEFT saves one; each file replaced atomically, so a reader never sees half of it."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        # The tensors are views into receive buffers: contiguous copies go to the file.
        weights = {name: tensor.contiguous() for name, tensor in self.tensors.items()}
        _write_atomically(self.directory / "adapter_model.safetensors", lambda path: save_file(weights, path))
        config = json.dumps({**self.config, "peft_type": "LORA"})
        _write_atomically(self.directory / "adapter_config.json", lambda path: Path(path).write_text(config))


def _write_atomically(target: Path, write: Any) -> None:
    # Several workers of one engine may share a host: each writes its own temporary file.
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    write(str(temporary))
    os.replace(temporary, target)
