"""What every backend is: a name, its traits, its checks, its init info, and the group it joins."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from lightning_vllm.engines import EngineTarget
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.weights.model import ModelMetadata
from lightning_vllm.weights.payload import Outgoing
from lightning_vllm.weights.shares import ShareSender


@dataclass(frozen=True)
class Traits:
    """What the rest of the package asks of a backend, instead of its name.

    Attributes:
        loads_while_receiving: the workers load each layer as it arrives (vLLM's layer-wise
            reload), so generation is paused around the whole transfer, and a failed transfer may
            leave the engine inside the update (``core/after_failure.py``); ``False``: the workers
            receive the whole update while vLLM serves and load it at the commit.
        carries_adapters: a LoRA adapter can be sent alone, staged for vLLM's LoRA loader.
        carries_shares: every trainer rank can send its own share of a push (``push_from="every_rank"``).
        needs_cuda: the trainer sends from a CUDA device.
        sends_every_push: a push always sends at least one tensor. vLLM's NCCL worker reads an update that names
            no tensor as "the tensors of the last update" and waits for them for good, so a changed-only push in
            which nothing changed sends its smallest layer group again.
    """

    loads_while_receiving: bool
    carries_adapters: bool
    carries_shares: bool
    needs_cuda: bool
    sends_every_push: bool = False


@dataclass(frozen=True)
class GroupSettings:
    """What a backend's init info is made of, for one engine's group (the trainer is rank 0)."""

    master_address: str
    master_port: int | None
    world_size: int
    bucket_size_bytes: int
    timeout_seconds: float
    largest_tensor_bytes: int = 0
    sends_as_held: bool = False
    """Every tensor is already in the engine's serving dtype on the trainer: a backend may hand the
    engine the trainer's own tensors rather than copies."""
    updates_in_one_call: bool = False
    """The engine's workers can start, load and finish an update in one call
    (``engines/base.UpdatesInOneCall``), for a backend whose workers need nothing more from the trainer
    while they load."""


WorkerReports = list[dict[str, Any]]
"""What an engine's workers report of the weights they hold, one report each (``weights/held_sums.held_layer_sums``)."""


@dataclass(frozen=True)
class Copying:
    """What :meth:`Sender.send` returns where the engine's copies of a push still run on its device after the commit
    (``lightning_ipc``).

    Attributes:
        wait: waits until they end (it raises as ``send`` does when they fail), before anything else reaches the
            engine; returns the workers' reports of what they then hold, where those came with the copies (a checked
            push: ``backends/lightning_ipc/sums_mailbox.py``), else ``None``.
        brings_sums: ``wait`` is expected to return the reports: the check need not ask the engine meanwhile.
    """

    wait: Callable[[], WorkerReports | None]
    brings_sums: bool = False


class Sender(ABC):
    """A joined group: sends pushes until it is shut down.

    Attributes:
        device: the device it sends from, where a push's tensors go first (``None``: where they are;
            the backend converts them on the way).
    """

    device: torch.device | None = None

    @abstractmethod
    def send(self, outgoing: Outgoing) -> Copying | None:
        """Send ``outgoing`` and commit it (``outgoing.client.finish_weight_update``); every wait bounded.

        Returns ``None`` once the engine holds the push, or, where the engine's copies of it still run on its device
        after the commit (``lightning_ipc``), the wait for them (:class:`Copying`): the push has landed when it
        returns.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Leave the group (the engine's side is released through the client)."""


class Backend(ABC):
    """One weight-transfer backend, as vLLM's ``weight_transfer_config={"backend": name}`` names it.

    Subclasses set ``name`` and ``traits`` and build their init info and their group; the
    checks have defaults that follow the traits.
    """

    name: ClassVar[str]
    traits: ClassVar[Traits]

    def check_trainer(self) -> None:
        """Raise unless this trainer process can send over this backend.

        Raises:
            EngineConfigError: it cannot (the message says why and what to use).
        """
        if self.traits.needs_cuda and not torch.cuda.is_available():
            raise EngineConfigError(
                f"backend={self.name!r} sends from the trainer's GPU, but this process has no CUDA device. Train on a "
                "GPU, or build the engine with weight_transfer_config={'backend': 'gloo'} to push from CPUs."
            )

    def check_engine(self, engine: EngineTarget, timeout_seconds: float) -> None:
        """Raise if ``engine`` was built without what this backend needs; a question to the engine waits at most
        ``timeout_seconds``. Nothing by default.

        Raises:
            EngineConfigError: the engine cannot take this backend's pushes (says how to build it).
        """
        return None

    def sender_device(self) -> torch.device | None:
        """The device the trainer sends from (``None``: the tensors' own, converted on the way)."""
        return torch.device("cuda", torch.accelerator.current_device_index()) if self.traits.needs_cuda else None

    @abstractmethod
    def init_info(self, settings: GroupSettings) -> TrainerInitInfo:
        """The trainer-side init info vLLM's ``WeightTransferTrainerFactory`` builds this backend from."""

    def share_sender(self, address: str, port: int) -> ShareSender:
        """A trainer rank other than 0's end of pushes every rank sends a share of, listening on ``address:port``
        (``traits.carries_shares``).

        Raises:
            EngineConfigError: this backend carries no shares.
        """
        raise EngineConfigError(
            f"push_from='every_rank' sends each trainer rank's share, which backend={self.name!r} cannot carry."
        )

    @abstractmethod
    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        """Form the group with the engine's workers (every wait bounded); its sender.

        Args:
            settings: the group's settings.
            client: the engine's control plane (bounded calls).
            engine_metadata: what every push will send at most: the engine's names and serving dtypes.
        """
