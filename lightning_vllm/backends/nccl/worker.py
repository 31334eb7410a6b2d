"""``nccl``: vLLM's NCCL worker engine, with a receive that ends when the trainer's side of the group fails.

vLLM's worker receives a push as NCCL broadcasts, and an NCCL kernel waits for its peer without a timeout. When the
trainer fails half way (its source raised, it timed out and left the group, its process was killed), vLLM's worker
stays in the broadcast for good: the engine core's ``update_weights`` never returns, and the engine serves nothing
again until it is restarted. vLLM says so itself ("the transfer group is unusable either way and the caller has to
tear it down"), and has no call that reaches a worker stuck there.

NCCL does tell: the peer's sockets close, and ``ncclCommGetAsyncError`` reports a remote error within about a
second. Measured on an H200 with two NCCL hosts on one GPU (``tests/gpu/nccl/peer_failure_probe.py``): the receiver's
stream never ended by itself; the error showed 1.1-1.6 s after the sender aborted or was SIGKILLed; the
receiver's own ``ncclCommAbort`` then ended its stream in 0.04 s.

So this engine is vLLM's, watched while it receives: a thread asks NCCL for the group's asynchronous error every
:data:`POLL_SECONDS`; on one, it turns the communicator off (vLLM's ``PyNcclCommunicator`` then makes no more NCCL
calls) and aborts it, which wakes the receive. What arrived after the failure is not loaded: the buffers of an
aborted broadcast hold whatever was there. ``receive_weights`` then raises, vLLM's ``update_weights`` returns its
error, and the trainer's side closes the update (``core/after_failure.py``); the next push joins a new group.
A new trainer's join also leaves the group still held (:meth:`WatchedNCCLWeightTransferEngine.init_transfer_engine`).

The plugin (``plugin.py``) registers it under vLLM's own name, ``nccl``: an engine built with
``weight_transfer_config={"backend": "nccl"}`` gets it in each worker, with no user code.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
"""How often the watch asks NCCL for the group's asynchronous error while a push is received (a cheap call)."""

_NCCL_SUCCESS, _NCCL_IN_PROGRESS = 0, 7
_ERROR_NAMES = {1: "unhandled CUDA error", 2: "system error", 3: "internal error", 6: "remote error"}


class PeerFailedError(RuntimeError):
    """The trainer's side of the NCCL group failed while this worker received a push; the group was aborted."""


class GroupWatch:
    """Watches an NCCL communicator (vLLM's ``PyNcclCommunicator``) from a thread of its own while it is used.

    Args:
        group: the communicator; turned off (``disabled``) and aborted when NCCL reports an asynchronous error.
        poll_seconds: how often NCCL is asked.
    """

    def __init__(self, group: Any, poll_seconds: float = POLL_SECONDS) -> None:
        self.group = group
        self.poll_seconds = poll_seconds
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def __enter__(self) -> GroupWatch:
        self._thread = threading.Thread(target=self._watch, name="lightning-vllm-nccl-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self.poll_seconds):
                code = async_error(self.group)
                if code in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS):
                    continue
                self.error = f"NCCL reported a {_ERROR_NAMES.get(code, f'failure (code {code})')} on the group"
                # Off first: vLLM's communicator makes no NCCL call once disabled, and an aborted one is freed.
                self.group.disabled, self.group.available = True, False
                device = self.group.device
                with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                    self.group.nccl.ncclCommAbort(self.group.comm)
                return
        except Exception:  # a watch that cannot ask NCCL leaves vLLM's receive as it was: say so, once
            log.exception("The NCCL weight-transfer group could not be watched; a failed trainer may leave it waiting")


def async_error(group: Any) -> int:
    """``ncclCommGetAsyncError`` of vLLM's communicator (vLLM's NCCL wrapper does not declare it)."""
    function = group.nccl.lib.ncclCommGetAsyncError
    if hasattr(function, "argtypes"):  # a C function (declared on it; a stand-in in the tests is Python)
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    result = ctypes.c_int(_NCCL_SUCCESS)
    function(group.comm, ctypes.byref(result))
    return int(result.value)


class WatchedNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL worker engine whose receive ends, with an error, when the trainer's side of the group fails."""

    def init_transfer_engine(self, init_info: Any) -> None:
        """Join a new trainer's group as vLLM's engine does, after leaving the one still held.

        vLLM's engine replaces its group without destroying it: a trainer killed between two pushes never released
        its group, and each new trainer would leave another communicator behind (its threads and sockets).
        """
        if self.model_update_group is not None:
            self.shutdown()  # vLLM's: aborts the communicator (its peer may be gone)
        super().init_transfer_engine(init_info)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """Receive a push as vLLM's engine does, watched (:class:`GroupWatch`).

        Raises:
            PeerFailedError: the trainer's side failed mid-push; nothing that arrived after it was loaded, and the
                group is gone (the next push joins a new one).
        """
        group = self.model_update_group
        if group is None or getattr(group, "disabled", True):
            super().receive_weights(update_info)  # (vLLM's error for a group never joined)
            return
        with self._watched(group) as watch, self._loads_checked(watch):
            super().receive_weights(update_info)

    @contextmanager
    def _watched(self, group: Any) -> Iterator[GroupWatch]:
        """Inside, ``group`` is watched (:class:`GroupWatch`); once NCCL reported a failure on it, the body's error, or
        its end, becomes a :class:`PeerFailedError` that says what this engine did about it (``_failure``)."""
        with GroupWatch(group) as watch:
            try:
                yield watch
            except Exception as error:
                if not watch.failed:
                    raise
                raise PeerFailedError(self._failure(watch)) from error
        if watch.failed:
            raise PeerFailedError(self._failure(watch))

    def _failure(self, watch: GroupWatch) -> str:
        self.model_update_group = None  # aborted: nothing left to destroy at shutdown
        try:
            self._restore_unfinished_layers()
        except Exception:  # the error of the push is what the trainer must get: this one is logged
            log.exception("Could not put back the layers a failed push left unfinished")
        return (
            f"The trainer's side of the NCCL weight-transfer group failed during a push ({watch.error}): the group was "
            "aborted and what arrived after the failure was not loaded. The trainer closes the update; its next "
            "push joins a new group."
        )

    def _restore_unfinished_layers(self) -> None:
        """Put back the weights of every layer the failed push had not finished, and end vLLM's layer-wise reload.

        vLLM's worker leaves the update when ``update_weights`` raises, but not its layer-wise reload: layers that
        had received nothing stay on the meta device, and the first generation afterwards kills the engine core
        ("Cannot copy out of meta tensor", seen on an H200 once the paused server's lease ran out). Its finalize
        puts back the weights of a layer that received nothing, and would build a layer that received part of its
        tensors from that part and uninitialized memory: such a layer is marked as having received nothing first.
        Layers the push finished keep its weights (the engine serves a mix, under the version it reported before).
        The trainer's own cleanup, when it lives, then finds the update closed (``core/after_failure.py``).
        """
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for layer in self.model.modules():
            info = get_layerwise_info(layer)
            if info.can_load() and info.load_numel > 0 and info.kernel_tensors is not None:
                info.load_numel, info.loaded_weights = 0, []  # back to the weights it held
        self.finish_weight_update()  # vLLM's finalize_layerwise_reload

    @contextmanager
    def _loads_checked(self, watch: GroupWatch) -> Iterator[None]:
        """Inside, the model's ``load_weights`` (what vLLM's receive hands each arrived tensor to) refuses tensors once
        the watch saw a failure: an aborted broadcast's buffer holds whatever was there."""
        model: Any = self.model  # (typed as a module: its load_weights is vLLM's model's)
        load: Callable[..., Any] = model.load_weights
        packed = getattr(self, "packed", True)

        def checked_load(weights: Any) -> Any:
            if not packed:  # one broadcast per tensor, queued before this call: wait for it to end or be aborted
                torch.cuda.current_stream().synchronize()
            if watch.failed:
                raise PeerFailedError(f"Not loading what arrived after the failure: {watch.error}")
            return load(weights)

        own = model.__dict__.get("load_weights")  # (a model may hold its loader as an attribute)
        model.load_weights = checked_load
        try:
            yield
        finally:
            if own is None:
                del model.load_weights  # the class's method again (the attribute shadowed it)
            else:
                model.load_weights = own
