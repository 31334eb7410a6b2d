"""``lightning_nccl``'s worker side: vLLM's packed NCCL receive into room of the worker's own, committed whole.

vLLM's ``nccl`` engine loads each chunk of a push as it arrives, inside its layer-wise reload. A push that fails half
way (the trainer's source raised, the trainer timed out or was killed, the engine core was frozen past the
trainer's timeout) leaves the layers it had finished holding the new weights: the engine serves a mix of two
versions under the one it reported before. Measured on an H200 (docs/runs.md): after an engine core frozen mid-push
was continued, its logprobs were 9.1e-4 from the *new* weights while it reported the old version.

This engine receives a push into a :class:`StagingRoom` (a tensor per name, on the worker's GPU, kept from push to
push; in pinned host memory when the GPU has no room, with one warning) and leaves the live weights alone until
``finish_weight_update``, the commit. The commit runs only when every tensor the update named has arrived and NCCL
reported no failure on the group (``backends/nccl/worker.GroupWatch``). It is one copy into the live weights, in
place, so the tensors vLLM's CUDA graphs point at stay: the model's own loaders, recorded once and replayed as
batched copies (``lightning_ipc/recorded_loads.py``), where vLLM uses weights as loaded; vLLM's layer-wise reload
from the room otherwise (quantized models, MLA). vLLM's ``finish_weight_update`` sets the version right after, in
the same call, so the version the engine reports always names the weights it serves.

A push that fails before its commit discards the room's contents: the engine serves the last committed weights
under their version. A trainer that dies after its last broadcast but before its commit leaves a staged push that
nothing commits: a new trainer's connection (``init_transfer_engine``) discards it, and the close the new trainer
sends first (``backend.py``) commits nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

from lightning_vllm.backends.lightning_ipc.recorded_loads import RecordedLoads, Replay
from lightning_vllm.backends.lightning_ipc.worker import loads_as_held, summing_replays
from lightning_vllm.backends.nccl.worker import GroupWatch, WatchedNCCLWeightTransferEngine

if TYPE_CHECKING:
    from lightning_vllm.weights.held_sums import WrittenSums

log = logging.getLogger(__name__)


class StagingRoom:
    """Where a push is received: one tensor per name, allocated at its first push and kept while its shape and dtype
    stay (an 8B model's room is its bytes, once).

    Args:
        device: the worker's GPU; a tensor that does not fit there goes to pinned host memory, with one warning.

    Example::

        >>> room = StagingRoom(torch.device("cpu"))
        >>> first = room.tensor_for("w", [2, 3], torch.float32)
        >>> room.tensor_for("w", [2, 3], torch.float32) is first, room.nbytes
        (True, 24)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        self.on_host = False  # some tensor is in host memory (the GPU had no room for it)
        self.allocations = 0  # tensors allocated so far: copies recorded against the room hold while it stays

    def tensor_for(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """``name``'s room, allocated anew only when its shape or dtype changed."""
        tensor = self.tensors.get(name)
        if tensor is None or list(tensor.shape) != list(shape) or tensor.dtype != dtype:
            tensor = self._allocate(shape, dtype)
            self.tensors[name] = tensor
            self.allocations += 1
        return tensor

    def _allocate(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        try:
            return torch.empty(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError:
            if not self.on_host:
                log.warning(
                    "The GPU has no room to stage a whole push (lightning_nccl): staging the rest in pinned host "
                    "memory, which makes each commit a copy from the host. Lower gpu_memory_utilization to leave the "
                    "engine room for one copy of the model's weights."
                )
            self.on_host = True
            return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())


class StagedNCCLWeightTransferEngine(WatchedNCCLWeightTransferEngine):
    """vLLM's NCCL worker engine whose pushes land whole or not at all (see the module docstring); vLLM builds it for
    ``weight_transfer_config={"backend": "lightning_nccl"}``."""

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.room = StagingRoom(device)
        self.in_place = loads_as_held(vllm_config)
        self.sums = summing_replays(lambda: self.model)
        self.loads = RecordedLoads(self.sums.summed if self.sums else None)  # the room's loads, recorded as copies
        self.staged: dict[str, torch.Tensor] = {}  # what this update received, in the room, by name
        self._expected: list[tuple[str, str, list[int]]] = []  # the last update's (name, dtype, shape): an empty
        # update names them again, as vLLM's trainer engine sends when nothing about them changed
        # The last commit's copies, by the names it had and the room's allocations then (a tensor allocated anew
        # is not where they copy from).
        self._replay: tuple[tuple[tuple[str, ...], int], Replay] | None = None

    def init_transfer_engine(self, init_info: Any) -> None:
        """Discard what a trainer that died before its commit staged, then join the new trainer's group."""
        self.staged, self._expected = {}, []
        super().init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """A new update: nothing staged yet, and no layer-wise reload opened (the live weights stay as they are)."""
        self.staged = {}

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """Receive a push into the room, watched; the live weights are not touched.

        Raises:
            PeerFailedError: the trainer's side failed mid-push; nothing of the push is kept, and the group is gone
                (the next push joins a new one).
        """
        group = self.model_update_group
        if group is None or getattr(group, "disabled", True):
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        if update_info.names:
            self._expected = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        try:
            with self._watched(group):
                self._receive(group)
        except Exception:
            self.staged = {}  # (nothing of a failed push is committed)
            raise

    def _receive(self, group: Any) -> None:
        if self.packed:
            packed_nccl_broadcast_consumer(
                iterator=self._expected_meta(),
                group=group,
                src=0,
                post_unpack_func=self._stage,
                buffer_size_bytes=self.packed_buffer_size_bytes,
                num_buffers=self.packed_num_buffers,
                device=self.device,
            )
            return
        stream = torch.cuda.current_stream(self.device)
        for name, (shape, dtype) in self._expected_meta():
            room = self.room.tensor_for(name, shape, dtype)
            landing = room if room.device == self.device else torch.empty(shape, dtype=dtype, device=self.device)
            group.broadcast(landing, src=0, stream=stream)
            if landing is not room:
                room.copy_(landing)
            self.staged[name] = room

    def _expected_meta(self) -> Iterator[tuple[str, tuple[list[int], torch.dtype]]]:
        for name, dtype_name, shape in self._expected:
            yield name, (shape, getattr(torch, dtype_name))

    def _stage(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one unpacked chunk into the room (on the receive's stream: the chunk's buffer is reused after it)."""
        for name, tensor in weights:
            room = self.room.tensor_for(name, list(tensor.shape), tensor.dtype)
            room.copy_(tensor, non_blocking=True)
            self.staged[name] = room

    def _failure(self, watch: GroupWatch) -> str:
        self.model_update_group = None  # aborted: nothing left to destroy at shutdown
        self.staged = {}
        return (
            f"The trainer's side of the NCCL weight-transfer group failed during a push ({watch.error}): the group was "
            "aborted and nothing of the push was loaded (lightning_nccl stages a push and commits it whole); the "
            "engine serves its last committed weights under their version. The trainer's next push joins a new group."
        )

    def finish_weight_update(self) -> None:
        """The commit: every tensor the update named, from the room into the live weights at once. An update that
        staged nothing (it failed, or a new trainer closes what a dead one left open) commits nothing.

        Raises:
            RuntimeError: the update staged part of what it named (nothing is committed).
        """
        staged, self.staged = self.staged, {}
        if not staged:
            return
        if self.sums:
            self.sums.loaded(None)  # (whatever this commit writes, the sums of an earlier one no longer tell of it)
        missing = [name for name, _, _ in self._expected if name not in staged]
        if missing:
            raise RuntimeError(
                f"The push reached this worker incomplete ({len(missing)} of {len(self._expected)} tensors missing, "
                f"the first {missing[0]!r}): nothing was committed. The next push sends every tensor again."
            )
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        weights = list(staged.items())
        # (vLLM's check that a load is complete is for checkpoints; a changed-only push names a part.)
        on_gpu = self.device.type == "cuda"
        with torch.cuda.device(self.device) if on_gpu else nullcontext(), torch.no_grad():
            with disable_mtp_completeness_check():
                if self.in_place and self.model is self._default_model and not self.room.on_host:
                    self._commit_in_place(weights)
                else:
                    self._commit_through_reload(weights)
            if on_gpu:
                torch.cuda.current_stream(self.device).synchronize()  # generation reads the weights next

    def _commit_in_place(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        names = (tuple(name for name, _ in weights), self.room.allocations)
        if self._replay is not None and self._replay[0] == names:
            self.loads.rerun(self._replay[1])  # the room's tensors stay put: the last commit's copies, again
            replay: Replay | None = self._replay[1]
        else:
            load_weights: Any = self.model.load_weights  # a vLLM model, not a bare Module
            replay = self.loads.load(load_weights, weights, self._held)
            self._replay = None if replay is None else (names, replay)
        if self.sums:
            self.sums.loaded(replay)

    def written_sums(self) -> WrittenSums | None:
        """The sums the last commit took of the parameters it wrote whole, as it copied them from the room
        (``held_sums.SumsWhatItWrites``): the check after the push reads only the others."""
        return self.sums.written_sums() if self.sums else None

    def _commit_through_reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layer-wise reload, from the room: for weights vLLM processes after loading."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.model.load_weights(weights)  # type: ignore[operator]  # a vLLM model, not a bare Module
        finalize_layerwise_reload(self.model, self.model_config)

    def _held(self) -> list[torch.Tensor]:
        """What a load may write: the model's parameters and buffers."""
        return [*self.model.parameters(), *self.model.buffers()]

    def shutdown(self) -> None:
        self.staged, self._expected, self._replay = {}, [], None
        super().shutdown()
