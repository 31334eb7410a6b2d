"""lightning-vllm: keep a vLLM engine on the weights a PyTorch Lightning Trainer is training.

Example::

    >>> from lightning.pytorch import Trainer
    >>> from lightning_vllm import VLLMWeightSync
    >>> trainer = Trainer(callbacks=[VLLMWeightSync(engine=llm, every_n_train_steps=4)])  # doctest: +SKIP
"""

from lightning_vllm.callback import VLLMWeightSync
from lightning_vllm.engines import (
    AsyncLLMEngine,
    EngineTarget,
    Generation,
    HTTPEngine,
    LocalLLMEngine,
    RayEngine,
    VLLMActor,
)
from lightning_vllm.errors import (
    EngineConfigError,
    EngineDeadError,
    StaleRolloutsError,
    WeightsMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from lightning_vllm.rollouts import generate
from lightning_vllm.server import PauseLease, PushedAdapters, RequireAPIKey
from lightning_vllm.updater import SyncStats, VLLMUpdater, vLLMUpdater

__all__ = [
    "PauseLease",
    "PushedAdapters",
    "RequireAPIKey",
    "StaleRolloutsError",
    "generate",
    "AsyncLLMEngine",
    "Generation",
    "HTTPEngine",
    "RayEngine",
    "VLLMActor",
    "EngineConfigError",
    "EngineDeadError",
    "EngineTarget",
    "LocalLLMEngine",
    "SyncStats",
    "VLLMUpdater",
    "VLLMWeightSync",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WeightsMismatchError",
    "vLLMUpdater",
]
