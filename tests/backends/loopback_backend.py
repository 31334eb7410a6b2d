"""A backend defined outside the package, to show what adding one takes: this module, and one
``register_backend("loopback", "loopback_backend", "LoopbackBackend")`` line.

It moves a push's tensors to an engine in the same process through a mailbox (no network), and
declares vLLM's way of loading: layer by layer while receiving, so the connection pauses
generation around the whole transfer; it carries no adapters and no shares.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.backends.base import Backend, GroupSettings, Sender, Traits
from lightning_vllm.weights.model import ModelMetadata
from lightning_vllm.weights.payload import Outgoing

MAILBOXES: dict[str, dict[str, torch.Tensor]] = {}
"""What each group's trainer put for its engine to take, by group."""


@dataclass
class LoopbackInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "loopback"
    group: str = ""


class LoopbackBackend(Backend):
    name: ClassVar[str] = "loopback"
    traits: ClassVar[Traits] = Traits(
        loads_while_receiving=True, carries_adapters=False, carries_shares=False, needs_cuda=False
    )

    def init_info(self, settings: GroupSettings) -> TrainerInitInfo:
        return LoopbackInitInfo(group=uuid.uuid4().hex, rank=0)

    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        info = self.init_info(settings)
        assert isinstance(info, LoopbackInitInfo)
        MAILBOXES[info.group] = {}
        client.init_weight_transfer_engine({"group": info.group})
        return LoopbackSender(info.group)


class LoopbackSender(Sender):
    def __init__(self, group: str) -> None:
        self.group = group

    def send(self, push: Outgoing) -> None:
        push.client.start_weight_update()
        names = []
        for name, tensor in push.weights.iter_full():
            MAILBOXES[self.group][name] = tensor.detach().clone()
            names.append(name)
        push.client.update_weights({"names": names})
        push.client.finish_weight_update()

    def shutdown(self) -> None:
        MAILBOXES.pop(self.group, None)
