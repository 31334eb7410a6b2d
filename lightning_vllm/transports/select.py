"""Choosing a backend and building the trainer-side settings vLLM's factory expects."""

from __future__ import annotations

import socket

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.transports.gloo.messages import GlooTrainerInitInfo

BACKENDS = ("auto", "gloo", "nccl", "ipc")


def resolve_backend(backend: str, *, engine_device: str) -> str:
    """Turn ``"auto"`` into a concrete backend; check any other name.

    ``auto`` picks ``nccl`` when the trainer has CUDA and vLLM runs on CUDA (the
    fast path between GPUs), and ``gloo`` otherwise. ``ipc`` (trainer and vLLM on
    the same GPU) is never picked automatically: it needs both on one device.

    Args:
        backend: one of ``BACKENDS``.
        engine_device: vLLM's device type, e.g. ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: for an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Invalid value for backend={backend!r}. Must be one of {', '.join(map(repr, BACKENDS))}.")
    if backend != "auto":
        return backend
    return "nccl" if engine_device == "cuda" and torch.cuda.is_available() else "gloo"


def _free_port(address: str) -> int:
    # Only for vLLM's NCCL engine, which binds the port itself: there is a short
    # window in which another process could take it. The gloo backend holds its
    # socket instead and has no such race.
    with socket.create_server((address, 0)) as probe:
        return int(probe.getsockname()[1])


def trainer_init_info(
    backend: str,
    *,
    master_address: str,
    master_port: int | None,
    world_size: int,
    bucket_size_bytes: int,
    timeout_seconds: float,
) -> TrainerInitInfo:
    """The trainer-side init info of ``backend`` (sender rank 0), ready for
    ``WeightTransferTrainerFactory.trainer_init``."""
    if backend == "gloo":
        return GlooTrainerInitInfo(
            master_address=master_address,
            master_port=master_port or 0,
            world_size=world_size,
            bucket_size_bytes=bucket_size_bytes,
            timeout_seconds=timeout_seconds,
            rank=0,
        )
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port or _free_port(master_address),
            world_size=world_size,
            packed=True,
            packed_buffer_size_bytes=bucket_size_bytes,
            rank=0,
        )
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_size_bytes, rank=0)
    raise ValueError(f"Invalid value for backend={backend!r}. Must be one of 'gloo', 'nccl', 'ipc'.")
