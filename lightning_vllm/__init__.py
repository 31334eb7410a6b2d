"""lightning-vllm: keep a vLLM engine on the weights a PyTorch Lightning Trainer is training.

The names below are imported when first used, not with the package: vLLM imports the
package in every one of its processes to load our transport plugin
(``lightning_vllm.in_vllm.plugin``), and those processes need the transport, not
Lightning or the callback.

Example::

    >>> from lightning.pytorch import Trainer
    >>> from lightning_vllm import VLLMWeightSync
    >>> trainer = Trainer(callbacks=[VLLMWeightSync(engine=llm, every_n_train_steps=4)])  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_vllm.core.push import SyncStats
    from lightning_vllm.core.weight_sync import WeightSync
    from lightning_vllm.engines import (
        AsyncLLMEngine,
        EngineTarget,
        Generation,
        HTTPEngine,
        LocalLLMEngine,
        RayEngine,
        VLLMActor,
    )
    from lightning_vllm.engines.placement import engine_on_gpus
    from lightning_vllm.errors import (
        EngineBusyError,
        EngineConfigError,
        EngineDeadError,
        PartialPushError,
        StaleRolloutsError,
        WeightsMismatchError,
        WeightSyncError,
        WeightSyncTimeoutError,
    )
    from lightning_vllm.fronts.lightning.callback import VLLMWeightSync
    from lightning_vllm.fronts.lightning.rollouts import generate
    from lightning_vllm.fronts.torchrl.updater import VLLMUpdater, vLLMUpdater
    from lightning_vllm.server import PauseLease, PushedAdapters, RequireAPIKey

# Each public name and the module that defines it.
_MODULES = {
    "VLLMWeightSync": "lightning_vllm.fronts.lightning.callback",
    "AsyncLLMEngine": "lightning_vllm.engines",
    "EngineTarget": "lightning_vllm.engines",
    "Generation": "lightning_vllm.engines",
    "HTTPEngine": "lightning_vllm.engines",
    "LocalLLMEngine": "lightning_vllm.engines",
    "RayEngine": "lightning_vllm.engines",
    "VLLMActor": "lightning_vllm.engines",
    "engine_on_gpus": "lightning_vllm.engines.placement",
    "EngineBusyError": "lightning_vllm.errors",
    "EngineConfigError": "lightning_vllm.errors",
    "EngineDeadError": "lightning_vllm.errors",
    "PartialPushError": "lightning_vllm.errors",
    "StaleRolloutsError": "lightning_vllm.errors",
    "WeightsMismatchError": "lightning_vllm.errors",
    "WeightSyncError": "lightning_vllm.errors",
    "WeightSyncTimeoutError": "lightning_vllm.errors",
    "generate": "lightning_vllm.fronts.lightning.rollouts",
    "PauseLease": "lightning_vllm.server",
    "PushedAdapters": "lightning_vllm.server",
    "RequireAPIKey": "lightning_vllm.server",
    "SyncStats": "lightning_vllm.core.push",
    "VLLMUpdater": "lightning_vllm.fronts.torchrl.updater",
    "vLLMUpdater": "lightning_vllm.fronts.torchrl.updater",
    "WeightSync": "lightning_vllm.core.weight_sync",
}

__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
