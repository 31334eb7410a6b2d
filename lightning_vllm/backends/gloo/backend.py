"""``gloo``: our backend for CPUs. Its wire and both of its ends are the modules beside this one (``__init__.py``
lists them); vLLM's factories know it through the plugin (``in_vllm/plugin.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.backends.base import Backend, GroupSettings, Sender, Traits
from lightning_vllm.backends.gloo.messages import GlooTrainerInitInfo
from lightning_vllm.backends.gloo.shares import GlooShareSender
from lightning_vllm.backends.gloo.trainer import GlooTrainerWeightTransferEngine
from lightning_vllm.in_vllm.plugin import register_backends
from lightning_vllm.weights import DeclaredWeights
from lightning_vllm.weights.model import ModelMetadata
from lightning_vllm.weights.shares import ShareSender


class GlooBackend(Backend):
    """Plain TCP from the trainer to every worker (``docs/index.md``, "One sync on the wire")."""

    name: ClassVar[str] = "gloo"
    traits: ClassVar[Traits] = Traits(
        loads_while_receiving=False, carries_adapters=True, carries_shares=True, needs_cuda=False
    )

    def init_info(self, settings: GroupSettings) -> TrainerInitInfo:
        return GlooTrainerInitInfo(
            master_address=settings.master_address,
            master_port=settings.master_port or 0,  # 0: the transport holds a port the kernel picks (no race)
            world_size=settings.world_size,
            bucket_size_bytes=settings.bucket_size_bytes,
            timeout_seconds=settings.timeout_seconds,
            rank=0,
        )

    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        register_backends()
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        engine = WeightTransferTrainerFactory.trainer_init(
            self.init_info(settings), client=client, source=DeclaredWeights(engine_metadata)
        )  # (each of its waits is bounded by timeout_seconds)
        assert isinstance(engine, GlooTrainerWeightTransferEngine)
        return engine  # (each push brings its own client: nothing of a push stays on it)

    def share_sender(self, address: str, port: int) -> ShareSender:
        return GlooShareSender(address, port)
