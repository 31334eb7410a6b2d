"""``lightning_ipc``: vLLM's CUDA-IPC protocol with handles kept open, for an engine on the trainer's own GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.backends.base import GroupSettings, Sender
from lightning_vllm.backends.ipc.backend import IPCBackend
from lightning_vllm.weights.model import ModelMetadata

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo


class InPlaceIPCBackend(IPCBackend):
    """``lightning_ipc``: vLLM's CUDA-IPC protocol, each tensor's handle sent once while the trainer's storage
    stays put (``trainer.py``), into workers that load a push with one batched copy and keep
    the handles open (``worker.py``)."""

    name: ClassVar[str] = "lightning_ipc"

    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        """As ``ipc``'s, with our trainer engine in vLLM's factory (vLLM's plugin loader may not have run in
        this process: an engine behind ``vllm serve`` or in Ray)."""
        from lightning_vllm.in_vllm.plugin import register_backends

        register_backends()
        return super().join(settings, client, engine_metadata)

    def init_info(self, settings: GroupSettings) -> TrainerInitInfo:
        """As ``ipc``'s; the wait for the worker's copies after the commit is bounded by ``timeout_seconds``, and
        an engine that can take the update in one call (start, load, finish) is sent it so."""
        from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesTrainerInitInfo

        info = super().init_info(settings)
        assert isinstance(info, KeptHandlesTrainerInitInfo)
        info.landed_timeout_seconds = settings.timeout_seconds
        info.updates_in_one_call = settings.updates_in_one_call
        return info

    def init_info_class(self) -> type[IPCTrainerInitInfo]:
        """Ours: it names our trainer engine."""
        from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesTrainerInitInfo

        return KeptHandlesTrainerInitInfo
