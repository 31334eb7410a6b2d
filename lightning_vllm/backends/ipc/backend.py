"""``ipc``: vLLM's CUDA-IPC engine, for an engine on the trainer's own GPU (colocated)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm._waits import call_with_timeout
from lightning_vllm.backends.base import GroupSettings, Traits
from lightning_vllm.backends.vllm_engines import VLLMEngineBackend
from lightning_vllm.engines import EngineTarget
from lightning_vllm.engines.base import ChecksIPCHandles
from lightning_vllm.errors import EngineConfigError

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo


class IPCBackend(VLLMEngineBackend):
    """vLLM's CUDA-IPC engine: the worker opens handles of memory on the trainer's GPU and loads from it.

    When every tensor is already in the engine's serving dtype (``GroupSettings.sends_as_held``), the
    engine is handed the trainer's own tensors (vLLM's unpacked mode): the worker's load is the one
    copy a push makes. Otherwise vLLM's packed producer converts them into one buffer of
    ``bucket_size_bytes`` at a time, which bounds the trainer's extra memory.
    """

    name: ClassVar[str] = "ipc"
    traits: ClassVar[Traits] = Traits(
        loads_while_receiving=True, carries_adapters=False, carries_shares=False, needs_cuda=True
    )

    def check_trainer(self) -> None:
        """Also: one trainer process. vLLM's IPC engine all-gathers CUDA handles over the default process
        group whenever it has several ranks (one trainer rank per colocated worker), while pushes here go
        from rank 0 alone: with several trainer processes it would wait for ranks that never send."""
        super().check_trainer()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise EngineConfigError(
                f"backend={self.name!r} with {dist.get_world_size()} trainer processes: vLLM's IPC engine gathers CUDA "
                "handles from every trainer rank, each beside a worker of its own, but lightning-vllm pushes from "
                "rank 0 alone. Build the engine with weight_transfer_config={'backend': 'nccl'} to push from several "
                "trainer ranks."
            )

    def check_engine(self, engine: EngineTarget, timeout_seconds: float) -> None:
        """The engine must carry vLLM's CUDA IPC handles (``engines/serialization.py``)."""
        if isinstance(engine, ChecksIPCHandles):
            what = f"{engine.description} to describe its RPC"
            if problem := call_with_timeout(engine.ipc_handles_problem, timeout=timeout_seconds, what=what):
                raise EngineConfigError(problem)

    def init_info(self, settings: GroupSettings) -> TrainerInitInfo:
        """Unpacked when the trainer holds the tensors as the engine loads them; packed otherwise. vLLM's
        packed producer refuses a tensor larger than its buffer (a large vocabulary's embedding is
        ~0.5 GB), so the buffer grows to the largest tensor when that is larger than ``bucket_size_bytes``."""
        packed = not settings.sends_as_held
        buffer_size = max(settings.bucket_size_bytes, settings.largest_tensor_bytes)
        return self.init_info_class()(packed=packed, packed_buffer_size_bytes=buffer_size, rank=0)

    def init_info_class(self) -> type[IPCTrainerInitInfo]:
        """vLLM's trainer factory picks the trainer engine by the init info's class (its ``backend``)."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo
