"""Choosing a backend and building the trainer-side settings vLLM's factory expects."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.errors import EngineConfigError
from lightning_vllm.options import check_backend_name
from lightning_vllm.transports.gloo.messages import GlooTrainerInitInfo

GPU_BACKENDS = ("nccl", "ipc")
"""vLLM's own engines: they send from the trainer's GPU."""


def backend_for_engine(requested: str, configured: str | None, engine: str) -> str:
    """The backend to push with to an engine built with ``configured`` (its ``weight_transfer_config``).

    Raises:
        EngineConfigError: the engine has no weight-transfer config, or another backend than
            ``requested``; the message says how to build it.
    """
    if configured is None:
        suggested = "gloo" if requested == "auto" else requested
        raise EngineConfigError(
            f"The {engine} engine was built without a weight-transfer config, so it cannot receive "
            f"weights. Build it with weight_transfer_config={{'backend': '{suggested}'}}."
        )
    backend = resolve_backend(requested, engine_backend=configured)
    if configured != backend:
        raise EngineConfigError(
            f"The {engine} engine expects weight-transfer backend {configured!r} but this updater "
            f"uses {backend!r}. Build the engine with weight_transfer_config={{'backend': '{backend}'}} or pass "
            f"backend={configured!r} to the updater."
        )
    return backend


def resolve_backend(backend: str, *, engine_backend: str) -> str:
    """The backend to push with: ``"auto"`` takes the one the engine was built with.

    The engine's ``weight_transfer_config`` is the one fact both sides must agree on, so
    ``auto`` follows it (``gloo``, ``nccl`` or ``ipc``) rather than guessing from the
    trainer's hardware; any other name is kept, and the connection checks it against
    the engine.

    Args:
        backend: one of ``BACKENDS``.
        engine_backend: the backend of the engine's ``weight_transfer_config``.

    Raises:
        ValueError: for an unknown backend name.

    Example::

        >>> resolve_backend("auto", engine_backend="nccl"), resolve_backend("gloo", engine_backend="nccl")
        ('nccl', 'gloo')
    """
    check_backend_name(backend)
    return engine_backend if backend == "auto" else backend


def check_trainer_can_send(backend: str) -> None:
    """Raise unless this trainer process can send over ``backend``.

    vLLM's ``nccl`` and ``ipc`` send from CUDA. vLLM's IPC engine also all-gathers CUDA
    handles over the default process group whenever it has several ranks (one trainer
    rank per colocated worker), while pushes here go from rank 0 alone: with several
    trainer processes it would wait for ranks that never send.

    Raises:
        EngineConfigError: ``backend`` cannot be sent from this process (the message says why and what to use).
    """
    if backend in GPU_BACKENDS and not torch.cuda.is_available():
        raise EngineConfigError(
            f"backend={backend!r} sends from the trainer's GPU, but this process has no CUDA device. Train on a GPU, "
            "or build the engine with weight_transfer_config={'backend': 'gloo'} to push from CPUs."
        )
    if backend == "ipc" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise EngineConfigError(
            f"backend='ipc' with {dist.get_world_size()} trainer processes: vLLM's IPC engine gathers CUDA handles "
            "from every trainer rank, each beside a worker of its own, but lightning-vllm pushes from rank 0 alone. "
            "Build the engine with weight_transfer_config={'backend': 'nccl'} to push from several trainer ranks."
        )


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
    largest_tensor_bytes: int = 0,
) -> TrainerInitInfo:
    """The trainer-side init info of ``backend`` (sender rank 0), ready for
    ``WeightTransferTrainerFactory.trainer_init``.

    vLLM's packed IPC producer refuses a tensor larger than its buffer (a large vocabulary's
    embedding is ~0.5 GB), so for ``ipc`` the buffer grows to ``largest_tensor_bytes`` when
    that is larger than ``bucket_size_bytes``; NCCL's producer sends such a tensor alone.
    """
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

        buffer_size = max(bucket_size_bytes, largest_tensor_bytes)
        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=buffer_size, rank=0)
    raise ValueError(f"Invalid value for backend={backend!r}. Must be one of 'gloo', 'nccl', 'ipc'.")
