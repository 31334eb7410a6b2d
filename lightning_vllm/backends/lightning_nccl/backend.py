"""``lightning_nccl``'s trainer side: vLLM's NCCL trainer engine, into workers that stage a push and commit it whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from lightning_vllm.backends.base import GroupSettings, Sender, Traits
from lightning_vllm.backends.nccl.backend import NCCLBackend
from lightning_vllm.weights.model import ModelMetadata

_NOTHING_OPEN = "without a matching start_weight_update"
"""What vLLM's worker says to a ``finish_weight_update`` when no update is open."""


@dataclass
class StagedNCCLTrainerInitInfo(NCCLTrainerInitInfo):
    """vLLM's NCCL trainer init info, dispatched by vLLM's trainer factory under ``lightning_nccl`` (to vLLM's own
    NCCL trainer engine: the trainer's side sends as ``nccl``'s does)."""

    backend: ClassVar[str] = "lightning_nccl"


class StagedNCCLBackend(NCCLBackend):
    """``lightning_nccl``: vLLM's packed NCCL broadcast into workers that receive a push into room of their own and
    commit it whole at ``finish_weight_update`` (``worker.py``): a push lands whole or not at all, and the version an
    engine reports names the weights it serves. Costs the engine one copy of the model's weights in GPU memory.

    Generation is not paused while the push is received (the live weights are not touched then), only around the
    commit, as over ``gloo``.
    """

    name: ClassVar[str] = "lightning_nccl"
    traits: ClassVar[Traits] = Traits(
        loads_while_receiving=False,
        carries_adapters=False,
        carries_shares=False,
        needs_cuda=True,
        sends_every_push=True,
    )

    def init_info_class(self) -> type[NCCLTrainerInitInfo]:
        """Ours: vLLM's trainer factory dispatches it under ``lightning_nccl``."""
        return StagedNCCLTrainerInitInfo

    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        """As ``nccl``'s, with our trainer factory entry in place, then closing an update a trainer left open on the
        workers when it died between its last broadcast and its commit: joining discarded what that trainer staged,
        so the close commits nothing (without it vLLM's workers would refuse every later update as one already
        open)."""
        from lightning_vllm.in_vllm.plugin import register_backends

        register_backends()  # (vLLM's plugin loader may not have run in this process)
        sender = super().join(settings, client, engine_metadata)
        try:
            client.close_open_update()
        except Exception as error:
            if _NOTHING_OPEN not in str(error):
                sender.shutdown()
                raise
        return sender
