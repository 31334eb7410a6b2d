"""``lightning_ipc``: vLLM's CUDA-IPC worker engine, loading a push with one batched copy.

vLLM's own ``ipc`` engine loads every push through its layer-wise reload
(``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``): each layer is rebuilt on
the meta device, materialized again, loaded, processed and copied back into the tensors
vLLM's CUDA graphs point at, so a push makes two copies and much Python work per tensor, and
every push opens each CUDA IPC handle again. Measured on an H200 (docs/runs.md), an 8B push
took 20× one device-to-device copy of its bytes, almost all inside the worker.

This engine is vLLM's, with three changes:

- **One copy.** When the model's weights are used as loaded (no quantization, no MLA, the
  KV cache in the model's dtype, a CUDA GPU: vLLM processes nothing after loading then),
  the model's own weight loaders copy each tensor straight into the parameter it belongs
  to, the fused q/k/v and gate/up included. Otherwise it loads as vLLM's engine does.
- **Loaders run once.** That first in-place load of a tensor is recorded as the copies (and
  padding fills) it made (``recorded_loads.py``); later pushes replay them as a few batched copies,
  without vLLM's Python loaders. A loader that computes anything leaves no record, and its
  tensors keep going through it.
- **Handles kept open** (with our trainer engine, ``trainer.py``). Each tensor the trainer
  shares is a numbered *slot*, opened once here and kept; while the trainer's storage stays put
  (an optimizer step writes in place), later pushes name the slot instead of sending a handle,
  and its copies stay bound to it. A slot is dropped when the trainer says so (the tensor moved),
  at a new connection (``init_transfer_engine``) and at shutdown. Kept slots pin nothing new:
  they are the trainer's parameters, which are there anyway.

The worker's copies are queued on its stream and ``update_weights`` returns without waiting for them
(vLLM's waits for the device there). Our trainer engine sends an interprocess CUDA event once per
connection; the worker records it after each push's copies, and the trainer waits for it after the
commit, so the commit's calls (finish, version, prefix cache) run while the bytes move. The trainer's
push returns only once the copies are done, so its next write cannot race them; generation waits for
them on the device. Without the event, or with several workers (one event tells of one worker's
copies), ``finish_weight_update`` waits for the device instead.

The check after every push (``verify_pushes``) holds what the workers then hold against what
was sent, layer by layer.

**A push the trainer gave up on never lands.** Each update carries ``apply_before``, a moment on the
host's monotonic clock (CUDA IPC puts trainer and worker on one host) a little before the trainer's own
deadline. A worker that reaches the update later (its engine core was frozen, or its queue held it) refuses
it before opening anything or copying a byte (:func:`refuse_if_expired`): the trainer has reported the push
failed and kept its version, and the engine goes on serving that version's weights. Measured on an H200
before this check: an engine core stopped mid-push ran the queued update once continued and reported the
version the trainer had called not committed (issue 46).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo

from lightning_vllm.backends.lightning_ipc.recorded_loads import BoundLoad, RecordedLoads, Replay

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lightning_vllm.backends.lightning_ipc.summed_replay import LastReplaySums
    from lightning_vllm.weights.held_sums import WrittenSums


@dataclass
class KeptHandlesUpdateInfo(IPCWeightTransferUpdateInfo):
    """vLLM's IPC update info, with the trainer's slots (sent by ``KeptHandlesIPCTrainerEngine``).

    Attributes:
        slots: one number per name: the trainer's tensor, opened by this worker the first time its
            handle came (an empty handle dict then means "the one already opened"); ``None`` from a
            trainer that keeps no handles (every handle is new, nothing is kept).
        released: slots the trainer no longer holds the same tensor in: closed before anything else.
        landed_event: the IPC handle of the trainer's interprocess CUDA event, sent once per connection:
            this worker records it after queuing a push's copies, and the trainer waits for it, instead of
            this worker waiting for its device before it answers.
        apply_before: the last ``time.monotonic()`` at which this worker may start loading the push (see
            :func:`refuse_if_expired`); ``None`` from a trainer that sets none.
        sums_mailbox: the CUDA IPC handle of the trainer's tensor for this worker's sums, sent once per connection
            (``sums_mailbox.py``).
        sums_push: the number of a push whose check wants this worker's sums posted there, before the trainer's
            event is recorded; ``None``: not wanted.
    """

    slots: list[int] | None = None
    released: list[int] = field(default_factory=list)
    landed_event: bytes | None = None
    apply_before: float | None = None
    sums_mailbox: tuple[Any, ...] | None = None
    sums_push: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slots is not None and len(self.slots) != len(self.names):
            raise ValueError(
                f"`slots` should be of the same size as `names`: got {len(self.slots)} and {len(self.names)}"
            )


class PushExpiredError(RuntimeError):
    """A push reached the worker after its ``apply_before``: it was not loaded (the trainer gave up on it)."""


def refuse_if_expired(apply_before: float | None) -> None:
    """Refuse a push that reached this worker after ``apply_before`` (``time.monotonic()``, the host's clock).

    Raises:
        PushExpiredError: it is late; nothing was opened or copied.
    """
    if apply_before is None:
        return
    late = time.monotonic() - apply_before
    if late > 0:
        raise PushExpiredError(
            f"This push reached the vLLM worker {late:.2f} s after the last moment the trainer allowed for loading "
            "it (its timeout_seconds, less a margin): it was not loaded. The trainer has reported it failed and "
            "kept its version; the engine serves that version's weights. If the engine is only slow, raise "
            "timeout_seconds."
        )


def update_in_one_call(worker: Any, update_info: dict[str, Any]) -> None:
    """vLLM's ``start_weight_update``, ``update_weights`` and ``finish_weight_update`` on ``worker``, sent as one
    ``collective_rpc`` (``engines/base.UpdatesInOneCall``): the worker's own methods, so its bookkeeping (one
    update at a time, an update that failed ends) is vLLM's. For a worker that loads while the call runs: the
    CUDA IPC engines, whose tensors are on the trainer's GPU before the call. A late push is refused before
    the update starts (:func:`refuse_if_expired`)."""
    refuse_if_expired(update_info.get("apply_before"))
    worker.start_weight_update()
    worker.update_weights(update_info)
    worker.finish_weight_update()


def opened(handle: tuple[Any, ...], device: torch.device) -> torch.Tensor:
    """The tensor a trainer shared as ``handle`` (``reduce_tensor``'s arguments), opened on ``device``."""
    args = list(handle)
    args[6] = device.index  # the device index, as this worker numbers its GPUs (vLLM does the same)
    tensor: torch.Tensor = rebuild_cuda_tensor(*args)
    return tensor


def summing_replays(model: Callable[[], torch.nn.Module]) -> LastReplaySums | None:
    """What makes a worker engine's replays sum what they write (``summed_replay.py``), or ``None`` where its kernel
    cannot be imported (no Triton): the check then reads the live weights."""
    try:
        from lightning_vllm.backends.lightning_ipc.summed_replay import LastReplaySums
    except ImportError:
        return None
    return LastReplaySums(model)


def loads_as_held(vllm_config: Any) -> bool:
    """Whether vLLM uses this model's weights as its loaders store them (nothing is processed after
    loading), so that a push can be loaded straight into the parameters.

    Conservative: quantized models (their scales and repacked layouts), MLA attention (derived
    projections), a KV cache in another dtype (its scales) and non-CUDA platforms (vLLM's CPU build
    repacks linear layers) go through vLLM's layer-wise reload.
    """
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    return (
        current_platform.is_cuda()
        and model_config.quantization is None
        and not getattr(model_config, "use_mla", False)
        and str(getattr(vllm_config.cache_config, "cache_dtype", "auto")) == "auto"
    )


class InPlaceIPCWeightTransferEngine(IPCWeightTransferEngine):
    """vLLM's ``IPCWeightTransferEngine`` that loads with one batched copy and keeps its handles open (see the
    module docstring); vLLM builds it for ``weight_transfer_config={"backend": "lightning_ipc"}``."""

    update_info_cls = KeptHandlesUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.in_place = loads_as_held(vllm_config)
        self.sums = summing_replays(lambda: self.model)
        self.loads = RecordedLoads(self.sums.summed if self.sums else None)  # the in-place loads, recorded as copies
        self._slots: dict[int, torch.Tensor] = {}  # the trainer's tensors, opened once
        self._bound: dict[int, BoundLoad] = {}  # each slot's load, resolved against its tensor
        self._opened: list[torch.Tensor] = []  # without slots: the last push's tensors, so their storages stay mapped
        self._landed: torch.cuda.Event | None = None  # the trainer's event, recorded after each push's copies
        self._mailbox: torch.Tensor | None = None  # the trainer's tensor for this worker's sums (sums_mailbox.py)
        # The last push's replay and its slots: a push naming the same slots, and no new handle, runs it again.
        self._replay: tuple[tuple[int, ...], Replay] | None = None
        # One event tells of one worker's copies: with several workers, each waits for its device in finish.
        self._alone = vllm_config.parallel_config.world_size == 1

    def init_transfer_engine(self, init_info: Any) -> None:
        self._forget_slots()  # a new trainer engine numbers its slots anew
        super().init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        if self.sums:
            self.sums.loaded(None)
        if not self._loads_in_place():
            super().start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, without its wait for the device when the trainer's own tensors are loaded in place: the
        copies run on while the trainer's next calls come (the trainer's event, or ``finish_weight_update``,
        says when they are done). A packed buffer is reused for the next chunk: that waits as vLLM does. A late
        push is refused before anything is opened (:func:`refuse_if_expired`)."""
        refuse_if_expired(update_info.get("apply_before"))
        if self.packed or not self._loads_in_place():
            super().update_weights(update_info)
            return
        info = self.parse_update_info(update_info)
        if isinstance(info, KeptHandlesUpdateInfo) and info.landed_event is not None and self._alone:
            self._landed = torch.cuda.Event.from_ipc_handle(self.device, info.landed_event)
        self.receive_weights(info)
        if isinstance(info, KeptHandlesUpdateInfo):
            self._post_sums(info)
        if self._landed is not None:
            self._landed.record(torch.cuda.current_stream(self.device))

    def _post_sums(self, info: KeptHandlesUpdateInfo) -> None:
        """Queue this worker's layers' sums into the trainer's tensor, where the push's check wants them and the load
        summed as it wrote (``sums_mailbox.py``): before the trainer's event, so they are there once it fires."""
        if info.sums_mailbox is None and info.sums_push is None:
            return
        # (Imported where a check wants it: the weights' fingerprints are no part of a worker that is not checked.)
        from lightning_vllm.backends.lightning_ipc.sums_mailbox import post_sums

        if info.sums_mailbox is not None:
            self._mailbox = opened(info.sums_mailbox, self.device)
        if info.sums_push is not None and self._mailbox is not None and self._alone and self.sums is not None:
            try:
                with torch.cuda.device(self.device):
                    post_sums(self._mailbox, info.sums_push, self.sums.layer_rows())
            except Exception:  # (the push has loaded: its check asks this worker through vLLM instead, as before)
                logger.exception("lightning_vllm could not post this worker's sums for the check; it is asked instead")
                self._mailbox = None  # (until the next connection lends another tensor)

    def finish_weight_update(self) -> None:
        if not self._loads_in_place():
            super().finish_weight_update()
            return
        if self._landed is None:
            # The copies were queued on this worker's stream: the trainer may write its tensors once this returns.
            torch.cuda.synchronize(self.device)
        else:
            # The trainer waits for its event; generation here waits for it on the device, on whichever stream
            # vLLM runs its model (its own, which it tracks, when it set one).
            from vllm.utils.torch_utils import current_stream

            for stream in (torch.cuda.current_stream(self.device), current_stream()):
                stream.wait_event(self._landed)
        self._packed_importer.close()  # as vLLM's engine does: the trainer may reuse its buffer

    def _loads_in_place(self) -> bool:
        # A speculative draft model is another target, loaded vLLM's way.
        return self.in_place and self.model is self._default_model

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        if self.sums:
            self.sums.loaded(None)  # (whatever this load writes, the sums of an earlier one no longer tell of it)
        if self.packed:
            super().receive_weights(update_info)
            return
        assert isinstance(update_info.ipc_handles, list)
        slots = update_info.slots if isinstance(update_info, KeptHandlesUpdateInfo) else None
        released = update_info.released if isinstance(update_info, KeptHandlesUpdateInfo) else []
        kept = slots is not None and not released and not any(update_info.ipc_handles)
        if kept and self._replay is not None and self._replay[0] == tuple(slots or ()) and self._loads_in_place():
            # The tensors opened and bound at an earlier push, holding new values: its copies, again.
            with torch.cuda.device(self.device):
                self.loads.rerun(self._replay[1])
            if self.sums:
                self.sums.loaded(self._replay[1])
            return
        self._replay = None
        for slot in released:
            self._slots.pop(slot, None)
            self._bound.pop(slot, None)
        weights = [
            (name, self._tensor(name, handle, None if slots is None else slots[position]))
            for position, (name, handle) in enumerate(zip(update_info.names, update_info.ipc_handles))
        ]
        if slots is None:  # kept until the next push has opened its own (PyTorch's IPC cache reuses the mappings)
            self._opened = [tensor for _, tensor in weights]
        if not self._loads_in_place():
            with self._loading():
                self.model.load_weights(weights)  # type: ignore[operator]  # a vLLM model, not a bare Module
            return
        numbers: list[int | None] = list(slots) if slots is not None else [None] * len(weights)
        bound = [self._bound_load(name, tensor, slot) for (name, tensor), slot in zip(weights, numbers)]
        with torch.cuda.device(self.device), self._loading():
            load_weights = self.model.load_weights  # a vLLM model, not a bare Module
            replay = self.loads.load(load_weights, weights, self._held, bound)  # type: ignore[arg-type]
        if replay is None:
            for number in numbers:  # bound to the plans this load replaced
                if number is not None:
                    self._bound.pop(number, None)
            return
        if self.sums:
            self.sums.loaded(replay)
        if slots is not None:
            self._replay = (tuple(slots), replay)

    def written_sums(self) -> WrittenSums | None:
        """The sums the last load took of the parameters it wrote whole (``held_sums.SumsWhatItWrites``): the check
        after the push reads only the others."""
        return self.sums.written_sums() if self.sums else None

    def _held(self) -> list[torch.Tensor]:
        """What a load may write: the model's parameters and buffers."""
        return [*self.model.parameters(), *self.model.buffers()]

    def _tensor(self, name: str, handle: dict[str, tuple], slot: int | None) -> torch.Tensor:
        if slot is not None and not handle:
            if slot not in self._slots:
                raise ValueError(
                    f"The trainer sent {name!r} as slot {slot}, which this worker has not opened (it was released, or "
                    "the worker restarted). Reconnect the updater: a new connection sends every handle again."
                )
            return self._slots[slot]
        gpu_id = str(torch.cuda.get_device_properties(self.device.index).uuid)
        if gpu_id not in handle:
            raise ValueError(f"IPC handle not found for GPU UUID {gpu_id}. Available UUIDs: {list(handle)}")
        tensor = opened(handle[gpu_id], self.device)
        if slot is not None:
            self._slots[slot] = tensor
            self._bound.pop(slot, None)
        return tensor

    def _bound_load(self, name: str, tensor: torch.Tensor, slot: int | None) -> BoundLoad | None:
        if slot is not None and slot in self._bound:
            return self._bound[slot]
        load = self.loads.bind(name, tensor)
        if load is not None and slot is not None:
            self._bound[slot] = load
        return load

    @contextmanager
    def _loading(self) -> Iterator[None]:
        """As vLLM's IPC engine loads: without autograd, without vLLM's check that a push is complete."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check(), torch.no_grad():
            yield

    def _forget_slots(self) -> None:
        self._slots, self._bound, self._opened, self._landed, self._replay = {}, {}, [], None, None
        self._mailbox = None

    def shutdown(self) -> None:
        self._forget_slots()
        super().shutdown()
