"""Where an in-process engine runs: :func:`engine_on_gpus`, to put it on other GPUs than the trainer's.

An in-process ``vllm.LLM`` or ``AsyncLLM`` runs its engine core and workers in processes of their own (vLLM's
default), and a CUDA process sees the GPUs ``CUDA_VISIBLE_DEVICES`` named when it started. So an engine started while
that variable names other GPUs uses those, and the trainer, which started with every GPU, keeps its own. The trainer
then reaches the engine over ``lightning_nccl`` (or ``nccl``): CUDA IPC needs both on one GPU (docs/gpu.md, "Choose a
backend"). ``vllm serve`` is placed the same way, on its command line (``CUDA_VISIBLE_DEVICES=1 vllm serve ...``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightning_vllm.errors import EngineConfigError

_VISIBLE = "CUDA_VISIBLE_DEVICES"


@contextmanager
def engine_on_gpus(*gpus: int) -> Iterator[None]:
    """Inside, a vLLM engine that starts uses only ``gpus`` (numbered as this process sees them: ``cuda:1`` is ``1``);
    this process keeps every GPU it had. Give the engine ``tensor_parallel_size=len(gpus)`` to use them all.

    CUDA is initialized in this process first: its view of the GPUs is then fixed, and vLLM spawns its engine core
    (it forks only before CUDA is in use), which reads ``CUDA_VISIBLE_DEVICES`` as it stands inside. The variable is
    put back on leaving, whatever happened.

    Args:
        gpus: the GPUs the engine may use; none of them need be free of the trainer, but a GPU the trainer uses
            shares its memory with the engine (``gpu_memory_utilization`` is a share of the whole GPU).

    Raises:
        EngineConfigError: no CUDA GPU here, no GPU or one twice given, a GPU this process does not see, or vLLM told
            to run its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where no placement is
            possible.

    Example::

        >>> from vllm import LLM  # doctest: +SKIP
        >>> with engine_on_gpus(1):  # doctest: +SKIP
        ...     llm = LLM(model=path, weight_transfer_config={"backend": "lightning_nccl"})
        >>> trainer = Trainer(accelerator="gpu", devices=[0], callbacks=[VLLMWeightSync(engine=llm)])  # doctest: +SKIP
    """
    visible = _visible_gpus(gpus)
    before = os.environ.get(_VISIBLE)
    os.environ[_VISIBLE] = ",".join(visible[gpu] for gpu in gpus)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_VISIBLE, None)
        else:
            os.environ[_VISIBLE] = before


def _visible_gpus(gpus: tuple[int, ...]) -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them, once ``gpus`` are found valid."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        raise EngineConfigError(
            "engine_on_gpus cannot place an engine whose engine core runs in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0): unset it, so that vLLM starts its engine core in a process of its own."
        )
    if not torch.cuda.is_available():
        raise EngineConfigError("engine_on_gpus needs CUDA GPUs, and this process sees none.")
    torch.cuda.init()  # (fixes this process's view before the variable changes; vLLM then spawns)
    count = torch.cuda.device_count()
    if not gpus or len(set(gpus)) != len(gpus) or not all(0 <= gpu < count for gpu in gpus):
        raise EngineConfigError(
            f"engine_on_gpus({', '.join(map(str, gpus))}): name each GPU once, by its index in this process "
            f"(0 to {count - 1}: it sees {count})."
        )
    named = os.environ.get(_VISIBLE)
    return named.split(",")[:count] if named else [str(gpu) for gpu in range(count)]
