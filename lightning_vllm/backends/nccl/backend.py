"""``nccl``: vLLM's NCCL engine, from the trainer's GPU to every worker's (separate GPUs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.backends.base import GroupSettings, Sender, Traits
from lightning_vllm.backends.vllm_engines import VLLMEngineBackend, free_port
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.weights.model import ModelMetadata

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

_SAME_GPU = "Duplicate GPU detected"
"""What NCCL says (vLLM's NCCL wrapper passes its last error on) when two ranks of one group are on one GPU."""


class NCCLBackend(VLLMEngineBackend):
    """vLLM's packed NCCL broadcast, buckets of ``bucket_size_bytes`` (a larger tensor goes alone)."""

    name: ClassVar[str] = "nccl"
    traits: ClassVar[Traits] = Traits(
        loads_while_receiving=True, carries_adapters=False, carries_shares=False, needs_cuda=True, sends_every_push=True
    )

    def init_info(self, settings: GroupSettings) -> TrainerInitInfo:
        return self.init_info_class()(
            master_address=settings.master_address,
            master_port=settings.master_port or free_port(settings.master_address),
            world_size=settings.world_size,
            packed=True,
            packed_buffer_size_bytes=settings.bucket_size_bytes,
            rank=0,
        )

    def init_info_class(self) -> type[NCCLTrainerInitInfo]:
        """vLLM's, which its trainer factory dispatches to its NCCL trainer engine."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo

    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        """As vLLM's; a worker on the trainer's own GPU is refused, saying what to use instead.

        NCCL puts each rank of a group on a GPU of its own. With a worker on the trainer's GPU, vLLM's NCCL
        init fails on both sides within a second (seen on an H200: docs/runs.md); the engine keeps serving.

        Raises:
            EngineConfigError: a vLLM worker is on the trainer's GPU.
        """
        try:
            return super().join(settings, client, engine_metadata)
        except Exception as error:
            if not any(_SAME_GPU in str(each) for each in _chain(error)):
                raise
            raise EngineConfigError(
                "backend='nccl' with a vLLM worker on the trainer's own GPU: NCCL puts each rank of a group on a GPU "
                f"of its own (it said: {_SAME_GPU}). For an engine beside the trainer on its GPU, build it with "
                "weight_transfer_config={'backend': 'lightning_ipc'} (or 'ipc'); else give the engine other GPUs "
                "(CUDA_VISIBLE_DEVICES where it starts)."
            ) from error


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes and contexts, each once."""
    found: list[BaseException] = []
    each: BaseException | None = error
    while each is not None and each not in found:
        found.append(each)
        each = each.__cause__ or each.__context__
    return found
