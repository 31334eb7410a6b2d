"""TorchRL's front end: ``VLLMUpdater`` (``updater.py``), TorchRL's ``vLLMUpdater`` interface on the core, and its
registration as TorchRL's ``WeightUpdaterBase``."""
