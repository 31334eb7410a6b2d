"""``nccl``: vLLM's NCCL engine, from the trainer's GPU to every worker's (separate GPUs)."""

from __future__ import annotations

from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.backends.base import GroupPlan, Traits
from lightning_vllm.backends.vllm_engines import VLLMEngineBackend, free_port


class NCCLBackend(VLLMEngineBackend):
    """vLLM's packed NCCL broadcast, buckets of ``bucket_size_bytes`` (a larger tensor goes alone)."""

    name: ClassVar[str] = "nccl"
    traits: ClassVar[Traits] = Traits(
        loads_while_receiving=True, carries_adapters=False, carries_shares=False, needs_cuda=True
    )

    def init_info(self, plan: GroupPlan) -> TrainerInitInfo:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=plan.master_address,
            master_port=plan.master_port or free_port(plan.master_address),
            world_size=plan.world_size,
            packed=True,
            packed_buffer_size_bytes=plan.bucket_size_bytes,
            rank=0,
        )
