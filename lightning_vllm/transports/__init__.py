"""How bytes move from the trainer to vLLM's workers.

``gloo`` (ours, CPUs) is implemented here; ``nccl`` and ``ipc`` are vLLM's own
engines, selected and configured by :func:`trainer_init_info`.
"""

from lightning_vllm.options import BACKENDS, check_backend_name
from lightning_vllm.transports.select import (
    GPU_BACKENDS,
    check_trainer_can_send,
    resolve_backend,
    trainer_init_info,
)

__all__ = [
    "BACKENDS",
    "GPU_BACKENDS",
    "check_backend_name",
    "check_trainer_can_send",
    "resolve_backend",
    "trainer_init_info",
]
