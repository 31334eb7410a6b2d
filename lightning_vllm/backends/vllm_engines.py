"""The one adapter over vLLM's trainer engines (``NCCLTrainerWeightTransferEngine``,
``IPCTrainerWeightTransferEngine``): where vLLM's API churn lands.

vLLM's design fixes a trainer engine's source and client at ``trainer_init`` and replays them in
each ``send_weights``. We keep to it: the engine gets a :class:`ReplayedWeights` and a
:class:`ReplayedClient` once, and each push loads its own weights and its own committing client
into them, never into vLLM's object. A transfer waits on NCCL and CUDA, which have no timeouts:
it runs on a thread of its own, bounded by ``timeout_seconds``, and ends as soon as the engine
is known to have died. A transfer thread that outlives its push cannot reach the engine: its
client is then an :class:`~lightning_vllm._waits.AbandonedClient`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine

from lightning_vllm._waits import call_watched
from lightning_vllm.backends.base import Backend, Copying, GroupSettings, Sender, WorkerReports
from lightning_vllm.engines.client import AbandonedClient
from lightning_vllm.weights import DeclaredWeights
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import ModelMetadata
from lightning_vllm.weights.payload import Outgoing

_DEATH_POLL_SECONDS = 0.1  # how often a transfer asks whether the engine died (free)


class ReplayedWeights(Weights):
    """The source vLLM's trainer engine keeps from ``trainer_init``: each push loads its own weights."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights

    def load(self, weights: Weights) -> None:
        """Replay ``weights`` at the next ``send_weights`` (their metadata is read anew)."""
        self.weights = weights
        self.__dict__.pop("metadata", None)  # (a cached property)

    def declare(self) -> list[ParamMeta]:
        return list(self.weights.metadata)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.weights.iter_full()

    def held_tensors(self) -> tuple[list[str], list[torch.Tensor]] | None:
        return self.weights.held_tensors()

    def held_signature(self) -> tuple[Any, ...] | None:
        return self.weights.held_signature()


class ReplayedClient:
    """The control-plane client vLLM's trainer engine keeps from ``trainer_init``: each push loads its
    own (whose ``finish_weight_update`` commits its version)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def free_port(address: str) -> int:
    """A free port on ``address``, for vLLM's NCCL engine, which binds the port itself: there is a
    short window in which another process could take it (the gloo backend holds its socket instead)."""
    with socket.create_server((address, 0)) as probe:
        return int(probe.getsockname()[1])


@runtime_checkable
class CopiesOutlastSend(Protocol):
    """A trainer engine whose ``send_weights`` may return while the engine's workers still copy the push (ours,
    ``lightning_ipc``'s: ``backends/lightning_ipc/trainer.py``), which waits for them in :meth:`wait_until_landed`
    instead of at the end of ``send_weights`` when ``caller_waits`` is set."""

    caller_waits: bool

    def wait_until_landed(self, check: Callable[[], None], check_seconds: float, deadline: float | None) -> None:
        """Wait until the last push's copies are done, at most until ``deadline`` (``time.monotonic()``), calling
        ``check`` every ``check_seconds``."""
        ...


@runtime_checkable
class MailsSums(Protocol):
    """A trainer engine whose worker can post its sums of what it holds to a mailbox the trainer reads once a push
    landed (ours, ``lightning_ipc``'s: ``backends/lightning_ipc/sums_mailbox.py``): the check then asks nothing."""

    sums_wanted: bool

    @property
    def sums_expected(self) -> bool:
        """The worker left them at the last push that wanted them."""
        ...

    def mailed_sums(self) -> WorkerReports | None:
        """The worker's sums after the last push, if wanted and posted."""
        ...


@runtime_checkable
class RefusesLatePushes(Protocol):
    """A trainer engine whose workers refuse a push that reaches them after ``apply_before`` (``time.monotonic()``
    on the host; ours, ``lightning_ipc``'s, whose workers share the trainer's host): a push the trainer gave up
    on then never lands under a version it did not commit."""

    apply_before: float | None


LATE_MARGIN_SECONDS = 1.0
"""How long before the trainer's own deadline its workers stop starting a push (at most a tenth of the
timeout): loading one starts with a clock read and queues its copies in milliseconds, so a push the worker
accepts is loaded before the trainer could report it failed."""


class VLLMEngineBackend(Backend):
    """A backend whose trainer side is one of vLLM's engines, joined through vLLM's factory."""

    def join(self, settings: GroupSettings, client: Any, engine_metadata: ModelMetadata) -> Sender:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        # vLLM 0.33's engines check at trainer_init the weights they will replay: what every push sends,
        # declared (the engine's metadata).
        source, replayed_client = ReplayedWeights(DeclaredWeights(engine_metadata)), ReplayedClient(client)
        engine = WeightTransferTrainerFactory.trainer_init(
            self.init_info(settings), client=replayed_client, source=source
        )
        return VLLMEngineSender(engine, source, replayed_client, self.sender_device(), settings.timeout_seconds)


class VLLMEngineSender(Sender):
    """Sends each push through a vLLM trainer engine, replaying what the push loads.

    Args:
        engine: vLLM's trainer engine, built with ``source`` and ``client``.
        device: the GPU the engine's communicator sends from (pushes may come from any thread).
        timeout_seconds: the longest a whole transfer may take.
    """

    def __init__(
        self,
        engine: TrainerWeightTransferEngine[Any],
        source: ReplayedWeights,
        client: ReplayedClient,
        device: torch.device | None,
        timeout_seconds: float,
    ) -> None:
        self.engine, self.source, self.client = engine, source, client
        self.device = device
        self.timeout_seconds = timeout_seconds
        # Copies that outlast send_weights are waited for by send's caller (see send).
        self._copies_outlast_send = engine if isinstance(engine, CopiesOutlastSend) else None
        if self._copies_outlast_send is not None:
            self._copies_outlast_send.caller_waits = True
        self._refuses_late = engine if isinstance(engine, RefusesLatePushes) else None
        self._mails_sums = engine if isinstance(engine, MailsSums) else None

    def send(self, outgoing: Outgoing) -> Copying | None:
        """See ``Sender.send``: with an engine whose copies outlast ``send_weights``, returns the wait for them, made
        on the caller's thread (handing the end of a push back from the transfer's thread, once they were done, cost
        a quarter of a millisecond of an 8B push on a GPU host: docs/runs.md), which returns the workers' sums for a
        checked push where they are left with the copies (:class:`MailsSums`)."""
        declared, between_pushes = self.source.weights, self.client.client
        self.source.load(outgoing.weights)
        self.client.client = outgoing.client
        deadline = time.monotonic() + self.timeout_seconds  # (for the whole transfer, the copies included)
        if self._refuses_late is not None:
            self._refuses_late.apply_before = deadline - min(LATE_MARGIN_SECONDS, self.timeout_seconds / 10)
        raise_if_dead = outgoing.client.raise_if_dead
        sums = self._mails_sums
        if sums is not None:
            sums.sums_wanted = outgoing.checked

        def bounded(step: Callable[[], None]) -> None:
            try:
                step()
            except BaseException:  # its transfer thread may go on: it must not reach the engine
                self.client.client = AbandonedClient(outgoing.what[0].upper() + outgoing.what[1:])
                raise

        def ended() -> None:
            self.source.load(declared)
            self.client.client = between_pushes

        bounded(lambda: self._transfer(outgoing.what, raise_if_dead))
        copies = self._copies_outlast_send
        if copies is None:
            ended()
            return None

        def landed() -> WorkerReports | None:
            bounded(lambda: copies.wait_until_landed(raise_if_dead, _DEATH_POLL_SECONDS, deadline))
            ended()
            return sums.mailed_sums() if sums is not None else None

        return Copying(landed, brings_sums=sums is not None and outgoing.checked and sums.sums_expected)

    def _transfer(self, what: str, check_alive: Callable[[], None]) -> None:
        device = self.device
        if device is not None and device.index is not None:
            # vLLM's producers read the tensors on streams of their own, which do not wait for the work this
            # thread queued on its stream (the optimizer step that wrote them). Seen on H200s: an FSDP2 push
            # gathered an embedding shard before AdamW had written it, and the engine got stale rows.
            torch.cuda.current_stream(device).synchronize()

        def send_on_device() -> None:  # on a thread of its own, whose current device is not the trainer's
            with torch.cuda.device(device) if device is not None and device.index is not None else nullcontext():
                self.engine.send_weights()

        # A call to an engine core that died is not woken up: the transfer ends as soon as it is known.
        call_watched(
            send_on_device,
            timeout=self.timeout_seconds,
            what=what,
            check=check_alive,
            interval=_DEATH_POLL_SECONDS,
            hint="The engine may have stopped mid-push; the version was not committed. With nccl and ipc, "
            "timeout_seconds bounds a whole push: raise it if pushes of this model take longer.",
        )

    def shutdown(self) -> None:
        self.engine.shutdown()
