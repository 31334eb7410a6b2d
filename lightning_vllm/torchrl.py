"""TorchRL's weight-sync scheme for vLLM on lightning-vllm: change one import line.

.. code-block:: python

    # from torchrl.weight_update.llm import VLLMWeightSyncScheme, get_model_metadata
    from lightning_vllm.torchrl import VLLMWeightSyncScheme, get_model_metadata

Importing this module imports torchrl (the ``torchrl`` extra); ``import lightning_vllm`` alone never does. The
classes live in ``fronts/torchrl/scheme.py``; see ``docs/torchrl.md``.
"""

from lightning_vllm.fronts.torchrl.scheme import (
    VLLMWeightReceiver,
    VLLMWeightSender,
    VLLMWeightSyncScheme,
    get_model_metadata,
)

__all__ = ["VLLMWeightReceiver", "VLLMWeightSender", "VLLMWeightSyncScheme", "get_model_metadata"]
