"""TorchRL's front end: ``VLLMUpdater`` (``updater.py``), TorchRL's ``vLLMUpdater`` interface on the core, and its
registration as TorchRL's ``WeightUpdaterBase``; ``VLLMWeightSyncScheme`` (``scheme.py``), TorchRL's weight-sync
scheme for vLLM on the same updater, which imports torchrl and is reached through ``lightning_vllm.torchrl``."""
