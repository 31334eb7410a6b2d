"""``lightning_ipc``'s trainer side: vLLM's IPC trainer engine, sending each tensor's handle once.

vLLM's ``IPCTrainerWeightTransferEngine`` exports a CUDA IPC handle for every tensor of every push
(``reduce_tensor``: an IPC event and a reference count each), and its worker opens them all again.
Between pushes an optimizer step writes the trainer's parameters in place: their storages stay
put, so the handles the worker opened at the first push still point at the new values.

This engine numbers each tensor it shares (a *slot*) and remembers its storage (weakly: it keeps
nothing alive) and its view. A later push of a tensor held in the same storage, with the same view,
names the slot with no handle; one whose storage moved or died (a tensor computed for the push:
merged LoRA weights, a dtype conversion) gets a new slot, and the old one is released. The worker
side (``worker.py``) keeps the slots open and the copies bound to them.

Unpacked pushes only (the trainer holds every tensor in the engine's dtypes), from one trainer
process; packed pushes are vLLM's, unchanged.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.multiprocessing.reductions import reduce_tensor
from typing_extensions import Self
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

from lightning_vllm.backends.lightning_ipc.sums_mailbox import SumsMailbox
from lightning_vllm.backends.lightning_ipc.worker import update_in_one_call
from lightning_vllm.errors import WeightSyncTimeoutError
from lightning_vllm.weights.base import Weights, WeightSource, held_view

_LANDED_POLL_SECONDS = 2e-5  # the copies of a push take milliseconds: a short poll is the wait's resolution


@dataclass
class KeptHandlesTrainerInitInfo(IPCTrainerInitInfo):
    """vLLM's IPC trainer init info, dispatched by vLLM's trainer factory to :class:`KeptHandlesIPCTrainerEngine`.

    Attributes:
        landed_timeout_seconds: the longest the trainer waits, after the commit, for the worker's copies.
        updates_in_one_call: the engine takes start, update and finish as one call
            (``engines/base.UpdatesInOneCall``); else vLLM's three.
    """

    backend: ClassVar[str] = "lightning_ipc"
    landed_timeout_seconds: float = 60.0
    updates_in_one_call: bool = False


@dataclass(frozen=True)
class _Shared:
    """A tensor the worker holds open as ``slot``: its storage (weakly) and the view it was shared as."""

    slot: int
    storage: weakref.ref[torch.UntypedStorage]
    view: tuple[Any, ...]

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.storage() is tensor.untyped_storage() and self.view == held_view(tensor)


class KeptHandlesIPCTrainerEngine(IPCTrainerWeightTransferEngine):
    """vLLM's IPC trainer engine whose unpacked pushes send a handle only for a tensor the worker has not
    opened yet (see the module docstring)."""

    init_info_cls = KeptHandlesTrainerInitInfo

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shared: dict[str, _Shared] = {}
        self._numbers = itertools.count()
        self.handles_sent = 0  # handles exported so far (the rest named a slot)
        self.landed_timeout_seconds = KeptHandlesTrainerInitInfo.landed_timeout_seconds  # set by trainer_init
        self.updates_in_one_call = False  # set by trainer_init
        self._landed: torch.cuda.Event | None = None  # recorded by the worker after each push's copies
        self._kept: dict[str, Any] | None = None  # the last update info whose every tensor named a kept slot
        self._kept_signature: tuple[Any, ...] | None = None  # its source's held signature, when it names them
        self._copies_pending = False  # the last push's copies may still run on the worker
        # Set by a caller that waits for the copies itself (wait_until_landed), on its own thread: send_weights
        # then returns while they run.
        self.caller_waits = False
        # Set by the caller before each push: the worker refuses the push after it (worker.refuse_if_expired).
        self.apply_before: float | None = None
        # Set by the caller before each push: the check wants the worker's sums in its mailbox (sums_mailbox.py).
        self.sums_wanted = False
        self._mailbox: SumsMailbox | None = None
        self._tensors = 0  # how many tensors the engine loads (its declared weights), set by trainer_init

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: WeightSource | None = None) -> Self:
        engine = super().trainer_init(init_info, client=client, source=source)
        engine.landed_timeout_seconds = init_info.landed_timeout_seconds
        engine.updates_in_one_call = init_info.updates_in_one_call
        engine._tensors = len(source.metadata) if isinstance(source, Weights) else 0
        return engine

    def _send_unpacked(self, source: WeightSource) -> list[torch.Tensor]:
        """Each tensor as a kept slot or a new handle, in one update call; the strong references the caller
        keeps past ``finish_weight_update`` (tensors made contiguous here exist only there)."""
        info, weight_refs = self._update_info(source)
        if self.is_sender:
            self.client.update_weights(self._timed(info))
        return weight_refs

    def _timed(self, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` with this push's ``apply_before``, and where the check wants them, the mailbox the worker is to post
        its sums to (a copy: the last info may be kept for the next push)."""
        extra: dict[str, Any] = {} if self.apply_before is None else {"apply_before": self.apply_before}
        if self.sums_wanted and self.is_sender:
            mailbox = self._mailbox
            if mailbox is None:
                tensors = max(self._tensors, len(info["names"]))
                mailbox = self._mailbox = SumsMailbox(torch.device("cuda", self.device_index), tensors)
            mailbox.name(info["names"])
            extra["sums_push"] = mailbox.next_push()
            if mailbox.handle is not None:
                extra["sums_mailbox"], mailbox.handle = mailbox.handle, None
        return {**info, **extra} if extra else info

    @property
    def sums_expected(self) -> bool:
        """Whether the worker is expected to post the next push's sums (it posted the last ones the check wanted)."""
        return self._mailbox is not None and self._mailbox.answered

    def mailed_sums(self) -> list[dict[str, Any]] | None:
        """The worker's sums of what it holds once the last push landed (``held_sums.held_layer_sums``'s report), if
        the check wanted them and the worker posted them (``sums_mailbox.py``); call after :meth:`wait_until_landed`."""
        if not self.sums_wanted or self._mailbox is None or self._copies_pending:
            return None
        return self._mailbox.read()

    def _update_info(self, source: WeightSource) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The update info of ``source`` (the fields of ``KeptHandlesUpdateInfo``, as vLLM's RPC carries them:
        ``dataclasses.asdict`` would deep-copy every handle, milliseconds on an 8B model), and the tensors it
        names. A push whose every tensor is the last one's, in its kept slot, reuses the last info."""
        if (last := self._kept_info(source)) is not None:
            return last, []  # (no tensor computed for this push: the source holds them all)
        names: list[str] = []
        handles: list[dict[str, tuple]] = []
        slots: list[int] = []
        released: list[int] = []
        weight_refs: list[torch.Tensor] = []
        assert isinstance(source, Weights), "lightning-vllm hands its trainer engines a Weights"
        for name, tensor in source.iter_full():
            weight = tensor.detach() if tensor.requires_grad else tensor  # (sources yield detached tensors)
            shared = self._shared.get(name)
            if shared is None or not shared.holds(weight):
                if shared is not None:
                    released.append(shared.slot)
                weight = weight.contiguous()
                shared = _Shared(next(self._numbers), weakref.ref(weight.untyped_storage()), held_view(weight))
                self._shared[name] = shared
                handles.append({self.gpu_uuid: reduce_tensor(weight)[1]})
                self.handles_sent += 1
            else:
                handles.append({})
            names.append(name)
            slots.append(shared.slot)
            weight_refs.append(weight)
        landed_event = None
        if self._landed is None:
            self._landed = torch.cuda.Event(interprocess=True)
            landed_event = self._landed.ipc_handle()
        kept = not released and landed_event is None and not any(handles)
        if kept and self._kept is not None and self._kept["slots"] == slots:
            return self._kept, weight_refs  # (the same slots name the same tensors, names, dtypes and shapes)
        info: dict[str, Any] = {
            "names": names,
            "dtype_names": [str(weight.dtype).split(".")[-1] for weight in weight_refs],
            "shapes": [list(weight.shape) for weight in weight_refs],
            "ipc_handles": handles,
        }
        info.update(slots=slots, released=released, landed_event=landed_event)
        self._kept = info if kept else None
        self._kept_signature = self._held_signature(source, names) if kept else None
        return info, weight_refs

    def _held_signature(self, source: Weights, names: list[str]) -> tuple[Any, ...] | None:
        """``source``'s held signature, if the tensors it holds are those just sent, as sent (checked once here, at
        every tensor; later pushes compare the signature alone)."""
        held = source.held_tensors()
        if (
            held is None
            or held[0] != names
            or [held_view(tensor) for tensor in held[1]] != [self._shared[name].view for name in names]
        ):
            return None
        return source.held_signature()

    def _kept_info(self, source: WeightSource) -> dict[str, Any] | None:
        """The last update info, when every tensor of ``source`` is the last push's, in its kept slot, read from the
        tensors the source holds (``Weights.held_signature``) without running ``iter_full``; ``None`` otherwise.

        Equal views name the same memory: PyTorch keeps a storage a worker maps until the worker lets go, so no
        other tensor can be at its address meanwhile; and a tensor of the dtype and place that was sent as held
        is sent as held again (nothing converts it)."""
        if self._kept is None or self._kept_signature is None or not isinstance(source, Weights):
            return None
        return self._kept if source.held_signature() == self._kept_signature else None

    def send_weights(self) -> None:
        """vLLM's (start, the update, the commit; or all three in one call, where the engine takes it), then a
        wait until the worker's copies of this push are done (:meth:`wait_until_landed`), unless the caller waits
        for them itself (``caller_waits``): the worker answered the commit's calls while it copied. A tensor
        dropped meanwhile is not reused: PyTorch keeps memory another process maps until that one lets go."""
        self._copies_pending = False
        if self.packed or not self.is_sender or not self.updates_in_one_call:
            super().send_weights()
        else:
            assert self.source is not None
            info, weight_refs = self._update_info(self.source)
            client: Any = self.client  # lightning-vllm's (engines/client.TimedClient), which takes it
            client.update_weights_in_one_call(update_in_one_call, self._timed(info))
            self._post_send_sync()
            del weight_refs
        # (vLLM's packed path, and a worker without our event, waited for the device before answering.)
        self._copies_pending = not self.packed and self.is_sender and self._landed is not None
        if not self.caller_waits:
            self.wait_until_landed()

    def wait_until_landed(
        self, check: Callable[[], None] = lambda: None, check_seconds: float = 0.1, deadline: float | None = None
    ) -> None:
        """Wait until the worker's copies of the last push are done (its record of our event), until ``deadline``
        (``time.monotonic()``; by default ``landed_timeout_seconds`` from now), calling ``check`` every
        ``check_seconds`` (it raises to end the wait: the engine died). Returns at once when there is nothing to
        wait for.

        Raises:
            WeightSyncTimeoutError: the copies did not end in time.
        """
        if not self._copies_pending:
            return
        self._copies_pending = False
        assert self._landed is not None
        now = time.monotonic()
        deadline = now + self.landed_timeout_seconds if deadline is None else deadline
        next_check = now + check_seconds
        while not self._landed.query():
            now = time.monotonic()
            if now > deadline:
                raise WeightSyncTimeoutError(
                    f"The vLLM worker's copies of this push did not end within {self.landed_timeout_seconds:g} s "
                    "(timeout_seconds). Check that the engine is alive, or raise timeout_seconds."
                )
            if now > next_check:
                check()
                next_check = now + check_seconds
            time.sleep(_LANDED_POLL_SECONDS)
