"""The ``gloo`` backend: vLLM's weight-transfer protocol over torch's gloo, for CPUs.

vLLM ships NCCL and CUDA-IPC engines only. This module adds both halves of a CPU
backend and registers them under the name ``gloo`` (see ``plugin.py``):

* :class:`GlooWeightTransferEngine` runs inside every vLLM worker. vLLM builds it
  when the engine was created with ``weight_transfer_config={"backend": "gloo"}``.
* :class:`GlooTrainerWeightTransferEngine` runs in the trainer and drives the
  four-phase handshake through a vLLM weight-sync client.

Both join one gloo group (trainer rank 0, workers after it) made from a
``torch.distributed.TCPStore`` and ``ProcessGroupGloo``: the global default process
group, which Lightning owns under DDP, is never touched. The trainer hosts the
store on a socket bound to the address it was given, so nothing listens on other
interfaces. No pickled data crosses the wire: control messages are the plain
dataclasses below, tensors are raw bytes.

A sync is one ``start_weight_update``, one ``update_weights`` (carrying the whole
bucket plan) and one ``finish_weight_update`` call, whatever the number of tensors.
"""

from __future__ import annotations

import datetime
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.distributed import DistStoreError, PrefixStore, ProcessGroupGloo, TCPStore
from typing_extensions import Self, override
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from lightning_vllm._waits import BackgroundCall, TimedClient
from lightning_vllm.errors import WeightSyncError, WeightSyncTimeoutError
from lightning_vllm.transports.buckets import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DEFAULT_COALESCE_BYTES,
    Bucket,
    Segment,
    TensorSpec,
    bucket_segments,
    plan_buckets,
    plan_segments,
    unpack_bucket,
)
from lightning_vllm.transports.staging import StagingRing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

DEFAULT_TIMEOUT_SECONDS = 120.0
# Slices of a bucket must hold whole elements of every wire dtype.
_ALIGNMENT = 8
_POLL_SECONDS = 0.05
# Waiting on a broadcast polls, so a failure of the workers' update call ends it early.
_WORK_POLL_SECONDS = 0.0005


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a clear error for anything that is not a dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype name {name!r} in a weight update; expected e.g. 'float32' or 'bfloat16'.")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def validate_bucket_size(bucket_size_bytes: int) -> None:
    """Raise ``ValueError`` unless the bucket size is positive and a multiple of 8 bytes."""
    if bucket_size_bytes <= 0 or bucket_size_bytes % _ALIGNMENT:
        raise ValueError(
            f"Invalid value for bucket_size_bytes={bucket_size_bytes}. "
            f"Must be a positive multiple of {_ALIGNMENT} (e.g. {DEFAULT_BUCKET_SIZE_BYTES})."
        )


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a vLLM worker needs to join the trainer's gloo group (sent once, at init)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        validate_bucket_size(self.bucket_size_bytes)
        if self.world_size < 2:
            raise ValueError(f"world_size={self.world_size} must count the trainer and at least one worker.")


@dataclass(kw_only=True)
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One sync's metadata and bucket plan (sent once per sync, before the bytes).

    ``bucket_ends[i]`` is the index one past the last tensor of bucket ``i``, and
    ``segment_ends`` the same for the segments (one broadcast each) inside the
    buckets; every bucket end is also a segment end.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_ends: list[int]
    segment_ends: list[int]

    def __post_init__(self) -> None:
        num_tensors = len(self.names)
        if len(self.dtype_names) != num_tensors or len(self.shapes) != num_tensors:
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor: got "
                f"{num_tensors}, {len(self.dtype_names)} and {len(self.shapes)}."
            )
        if self.bucket_ends != sorted(set(self.bucket_ends)) or (self.bucket_ends and self.bucket_ends[-1] != num_tensors):
            raise ValueError(f"bucket_ends={self.bucket_ends} must rise strictly and end at {num_tensors}.")
        if self.segment_ends != sorted(set(self.segment_ends)) or not set(self.bucket_ends) <= set(self.segment_ends):
            raise ValueError(
                f"segment_ends={self.segment_ends} must rise strictly and include every bucket end {self.bucket_ends}."
            )
        if self.segment_ends and self.segment_ends[-1] != num_tensors:
            raise ValueError(f"segment_ends={self.segment_ends} must end at {num_tensors}.")

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, dtype_from_name(dtype), tuple(shape))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes)
        ]

    def buckets(self, specs: Sequence[TensorSpec]) -> list[Bucket]:
        starts = [0, *self.bucket_ends[:-1]]
        return [
            Bucket(start, stop, sum(spec.num_bytes for spec in specs[start:stop]))
            for start, stop in zip(starts, self.bucket_ends)
        ]

    def segments(self, specs: Sequence[TensorSpec], bucket: Bucket) -> list[Segment]:
        return bucket_segments(specs, bucket, self.segment_ends)

    @classmethod
    def from_plan(
        cls, specs: Sequence[TensorSpec], buckets: Sequence[Bucket], segment_ends: Sequence[int] | None = None
    ) -> Self:
        """The message for a plan; without ``segment_ends``, each bucket is one segment."""
        bucket_ends = [bucket.stop for bucket in buckets]
        return cls(
            names=[spec.name for spec in specs],
            dtype_names=[dtype_name(spec.dtype) for spec in specs],
            shapes=[list(spec.shape) for spec in specs],
            bucket_ends=bucket_ends,
            segment_ends=list(segment_ends) if segment_ends is not None else bucket_ends,
        )


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that routes to ``host``.

    A UDP ``connect`` sends no packet; it only asks the kernel which interface it
    would use. Workers bind their gloo endpoint there, so a worker on the trainer's
    machine stays on loopback when the trainer is on loopback.
    """
    family, _, _, _, address = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def new_gloo_group(
    store: TCPStore, group_name: str, *, rank: int, world_size: int, address: str, timeout_seconds: float
) -> ProcessGroupGloo:
    """A gloo group of its own over ``store``, its endpoint bound to ``address``.

    Blocks until all ``world_size`` ranks have joined or ``timeout_seconds`` pass.
    """
    # torch's stubs omit the gloo options, the only way to bind the endpoint to one address.
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = datetime.timedelta(seconds=timeout_seconds)
    return ProcessGroupGloo(PrefixStore(group_name, store), rank, world_size, options)


def post_broadcast(group: ProcessGroupGloo, tensor: torch.Tensor) -> Any:
    """Start broadcasting a contiguous CPU tensor from rank 0; returns the ``Work`` to wait on.

    gloo runs posted collectives on its own threads, in the order they were posted on
    each rank, so both sides post the same sequence of sizes.
    """
    return group.broadcast(tensor, 0)  # type: ignore[attr-defined]  # torch's stubs omit it


def broadcast(group: ProcessGroupGloo, tensor: torch.Tensor, timeout_seconds: float) -> None:
    """Broadcast a contiguous CPU tensor from rank 0; blocks until every rank has it."""
    post_broadcast(group, tensor).wait(datetime.timedelta(seconds=timeout_seconds))


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker half of the ``gloo`` backend: receives buckets and loads them into vLLM's model.

    vLLM calls, in order: ``init_transfer_engine`` once (joins the group; blocks
    until the trainer and every other worker have joined), then for each sync
    ``start_weight_update`` (starts layer-wise reload), ``receive_weights`` (blocks
    on the trainer's broadcasts) and ``finish_weight_update`` (re-processes layers).
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._store: TCPStore | None = None
        self._group: ProcessGroupGloo | None = None
        self._receive_buffers: list[torch.Tensor] = []
        self._bucket_size_bytes = DEFAULT_BUCKET_SIZE_BYTES
        self._timeout_seconds = DEFAULT_TIMEOUT_SECONDS

    def worker_rank(self, rank_offset: int) -> int:
        """This worker's rank in the transfer group, unique across data-parallel replicas."""
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank + rank_offset

    @override
    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        self._bucket_size_bytes = init_info.bucket_size_bytes
        self._timeout_seconds = init_info.timeout_seconds
        timeout = datetime.timedelta(seconds=init_info.timeout_seconds)
        self._store = TCPStore(
            init_info.master_address, init_info.master_port, init_info.world_size, False, timeout
        )
        self._group = new_gloo_group(
            self._store,
            init_info.group_name,
            rank=self.worker_rank(init_info.rank_offset),
            world_size=init_info.world_size,
            address=local_address_towards(init_info.master_address),
            timeout_seconds=init_info.timeout_seconds,
        )

    @override
    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    @override
    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_embeddings(self.model)

    @override
    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would call torch.accelerator.synchronize(), which is
        # meaningless on a CPU worker; loads here are synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    @override
    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            for tensors in self.received_segments(update_info):
                self.model.load_weights(tensors)  # type: ignore[operator]  # every vLLM model has it

    def received_segments(self, update_info: GlooWeightTransferUpdateInfo) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receive the sync's tensors in order; yields named tensors as soon as they have landed.

        The receives of the current and the next bucket are posted ahead, so gloo's
        threads take the next bytes off the wire while the caller loads the ones
        yielded. Each yield holds one or more whole segments. Every wait is bounded
        by the timeout given at init.
        """
        group = self._group
        if group is None:
            raise RuntimeError("The gloo weight transfer is not initialised: call init_weight_transfer_engine first.")
        specs = update_info.specs()
        buckets = enumerate(update_info.buckets(specs))
        posted: deque[tuple[list[Any], list[tuple[str, torch.Tensor]], bool]] = deque()

        def post_next_bucket() -> None:
            bucket_index, bucket = next(buckets, (0, None))
            if bucket is None:
                return
            buffer = self._receive_buffer(bucket_index, bucket.num_bytes)
            segments = update_info.segments(specs, bucket)
            for index, segment in enumerate(segments):
                slices = segment.slices(self._bucket_size_bytes)
                works = [post_broadcast(group, buffer[begin:end]) for begin, end in slices]
                data = buffer[segment.offset : segment.offset + segment.num_bytes]
                tensors = unpack_bucket(data, specs[segment.start : segment.stop])
                posted.append((works, tensors, index == len(segments) - 1))

        def take() -> list[tuple[str, torch.Tensor]]:
            works, tensors, ends_bucket = posted.popleft()
            for work in works:
                work.wait(datetime.timedelta(seconds=self._timeout_seconds))
            if ends_bucket:
                post_next_bucket()
            return tensors

        post_next_bucket()
        post_next_bucket()
        while posted:
            ready = take()
            while posted and all(work.is_completed() for work in posted[0][0]):
                ready += take()  # load what has already landed in one call
            yield self._on_device(ready)

    def _receive_buffer(self, bucket_index: int, num_bytes: int) -> torch.Tensor:
        """Where bucket ``bucket_index`` of a sync lands: the same memory at every sync.

        Within a sync each bucket has its own buffer, because layer-wise reload keeps
        the loaded views until their layer is complete. Between syncs nothing refers
        to them any more (every layer has been processed into vLLM's own tensors), so
        they are kept and reused: fresh memory would be page-faulted in at every
        sync, which measured slower than the copy itself. The cost is one model's
        worth of bytes held by the worker between syncs (freed at shutdown).
        """
        kept = self._receive_buffers
        if bucket_index < len(kept) and kept[bucket_index].numel() >= num_bytes:
            return kept[bucket_index][:num_bytes]
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        if bucket_index < len(kept):
            kept[bucket_index] = buffer
        else:
            kept.append(buffer)
        return buffer

    def _on_device(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if self.device.type == "cpu":
            return tensors
        return [(name, tensor.to(self.device)) for name, tensor in tensors]

    @override
    def shutdown(self) -> None:
        self._group = None
        self._store = None
        self._receive_buffers = []


def refresh_tied_embeddings(model: torch.nn.Module) -> None:
    """Re-process embedding layers that share their weight with another layer.

    Works around vLLM 0.32 on CPU: the output embedding of a model that ties it to
    the input embedding (``lm_head``) loads no weight of its own, so layer-wise
    reload does not re-process it, and it keeps computing logits from the packed
    (oneDNN) copy of the *old* embedding it made at start. Its weight tensor is the
    new one, so re-running its processing rebuilds the packed copy. Unquantized
    embeddings only: their processing just repacks and can run again safely.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    for modules in holders.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of the ``gloo`` backend.

    Args:
        master_address: address the trainer listens on; workers must reach it there.
        master_port: port to listen on; 0 lets the operating system pick a free one
            while the socket is held, so no other process can take it in between.
        world_size: the trainer plus every vLLM worker.
        bucket_size_bytes: the largest packed bucket, and the trainer's staging memory.
        timeout_seconds: the longest any single wait may take.
    """

    backend: ClassVar[str] = "gloo"

    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    rank: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        validate_bucket_size(self.bucket_size_bytes)


def send_order(source: WeightSource) -> list[list[TensorSpec]]:
    """The source's tensors as layer groups, in the order ``iter_groups`` yields them."""
    by_name = {meta.name: TensorSpec(meta.name, meta.dtype, tuple(meta.shape)) for meta in source.metadata()}
    return [[by_name[name] for name in group] for group in source.groups()]


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer half of the ``gloo`` backend.

    Built with :meth:`trainer_init` (which returns once every worker has joined)
    and used with :meth:`send_weights`. Non-sender trainer ranks (rank > 0) hold no
    group and only iterate the source, so that collective gathers inside it (FSDP
    ``full_tensor()``) stay aligned across ranks.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        timed = client if isinstance(client, TimedClient) else TimedClient(client, timeout_seconds)
        super().__init__(client=timed, source=source, is_sender=is_sender)
        self.bucket_size_bytes = bucket_size_bytes
        self.timeout_seconds = timeout_seconds
        self.address: str | None = None
        self.port: int | None = None
        self._store: TCPStore | None = None
        self._group: ProcessGroupGloo | None = None
        self.coalesce_bytes = DEFAULT_COALESCE_BYTES
        self._staging: StagingRing | None = None

    @classmethod
    @override
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_size_bytes=init_info.bucket_size_bytes,
            timeout_seconds=init_info.timeout_seconds,
        )
        if engine.is_sender:
            engine._rendezvous(init_info)
        return engine

    def _rendezvous(self, init_info: GlooTrainerInitInfo) -> None:
        timeout = init_info.timeout_seconds
        try:
            listener = socket.create_server((init_info.master_address, init_info.master_port))
        except OSError as error:
            raise WeightSyncError(
                f"Cannot listen on {init_info.master_address}:{init_info.master_port} for the weight sync "
                f"rendezvous ({error}). Pass a master_address of this machine and a free master_port "
                "(or None to pick one)."
            ) from error
        self.address, self.port = init_info.master_address, listener.getsockname()[1]
        # The store takes over the bound socket, so it listens on this address only.
        self._store = TCPStore(
            self.address,
            self.port,
            init_info.world_size,
            True,
            datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        worker_info = GlooWeightTransferInitInfo(
            master_address=self.address,
            master_port=self.port,
            rank_offset=1,
            world_size=init_info.world_size,
            group_name=f"lightning_vllm/{uuid.uuid4().hex}",
            bucket_size_bytes=init_info.bucket_size_bytes,
            timeout_seconds=timeout,
        )
        # The workers block inside init_weight_transfer_engine until the group is
        # complete, and so does the trainer's ProcessGroupGloo constructor: both
        # must run at once. Whichever fails first ends the wait.
        workers = BackgroundCall(self.client.init_weight_transfer_engine, asdict(worker_info), what="vLLM workers to join")
        trainer = BackgroundCall(
            new_gloo_group,
            self._store,
            worker_info.group_name,
            rank=0,
            world_size=init_info.world_size,
            address=self.address,
            timeout_seconds=timeout,
            what="the gloo group to form",
        )
        hint = (
            f"Waited for {init_info.world_size - 1} vLLM worker(s) to join the gloo group at "
            f"{self.address}:{self.port}. Check that the engine was built with "
            "weight_transfer_config={'backend': 'gloo'}, that its workers can reach this address, "
            "and that vllm_tp_size matches the engine."
        )
        try:
            self._group = self._await_group(workers, trainer, timeout, hint)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _await_group(
        workers: BackgroundCall[None], trainer: BackgroundCall[ProcessGroupGloo], timeout: float, hint: str
    ) -> ProcessGroupGloo:
        deadline = time.monotonic() + timeout
        while not (workers.done() and trainer.done()):
            if workers.done():
                workers.result(0)  # raises the engine's error, if it failed
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"Timed out after {timeout:g} s. {hint}")
            time.sleep(_POLL_SECONDS)
        workers.result(0)
        try:
            return trainer.result(0)
        except DistStoreError as error:  # the store's own timeout: nobody came
            raise WeightSyncTimeoutError(f"Timed out after {timeout:g} s ({error}). {hint}") from error
        except RuntimeError as error:
            raise WeightSyncError(f"The gloo group did not form: {error}. {hint}") from error

    @override
    def send_weights(self, source: WeightSource | None = None) -> None:
        """Send every tensor of ``source`` (default: the one given at init) and load it in vLLM.

        Blocks until the workers have loaded the weights and finished the update,
        each wait bounded by ``timeout_seconds``.
        """
        source = source if source is not None else self.source
        if source is None:
            raise ValueError("No weights to send: pass a WeightSource to trainer_init or send_weights.")
        groups = send_order(source)
        tensors = (tensor for _, batch in source.iter_groups() for tensor in batch)
        if not self.is_sender:
            for _ in tensors:  # stay in step with the sender's collective gathers
                pass
            return
        if self._group is None:
            raise RuntimeError("The gloo trainer engine is not connected: build it with trainer_init.")
        self.client.start_weight_update()
        self.send_update(groups, tensors)
        self.client.finish_weight_update()

    def send_update(
        self,
        groups: Sequence[Sequence[TensorSpec]],
        tensors: Iterator[torch.Tensor],
        update: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Any:
        """One ``update_weights`` call and the broadcasts that carry its tensors.

        Must run between the client's ``start_weight_update`` and
        ``finish_weight_update``. ``tensors`` yields the tensors of ``groups`` in
        order. Blocks until the workers have loaded them (``timeout_seconds``).

        Args:
            groups: the tensor specs, one list per layer group, in send order.
            tensors: the tensors of ``groups``, in the same order.
            update: what asks the workers to receive (default: the client's
                ``update_weights``); it gets the update info as plain data.

        Returns:
            What ``update`` returned.
        """
        if self._group is None:
            raise RuntimeError("The gloo trainer engine is not connected: build it with trainer_init.")
        specs = [spec for group in groups for spec in group]
        buckets = plan_buckets(groups, self.bucket_size_bytes)
        segment_ends = plan_segments(specs, buckets, min(self.coalesce_bytes, self.bucket_size_bytes))
        update_info = GlooWeightTransferUpdateInfo.from_plan(specs, buckets, segment_ends)
        receive = BackgroundCall(
            update or self.client.update_weights, asdict(update_info), what="vLLM workers to load the weights"
        )
        self._send_segments(specs, [update_info.segments(specs, bucket) for bucket in buckets], tensors, receive)
        return receive.result(self.timeout_seconds)

    @property
    def group(self) -> ProcessGroupGloo | None:
        """The gloo group (the trainer is rank 0), or ``None`` before ``trainer_init`` and after ``shutdown``."""
        return self._group

    def _send_segments(
        self,
        specs: Sequence[TensorSpec],
        segments_per_bucket: Sequence[Sequence[Segment]],
        tensors: Iterator[torch.Tensor],
        receive: BackgroundCall[None],
    ) -> None:
        """Post every broadcast without waiting for the previous one, then wait for them all.

        Copies (packed small tensors, dtype conversions) go through the staging ring,
        which bounds them to one bucket; a ring region is reused only once the
        broadcast that reads it has finished. The other payloads are the source's own
        memory, so every broadcast must finish before this returns.
        """
        assert self._group is not None
        if self._staging is None:
            self._staging = StagingRing(self.bucket_size_bytes)
        ring = self._staging
        ring.reset()
        in_flight: deque[tuple[Any, int]] = deque()
        sent = 0

        def wait_oldest() -> None:
            nonlocal sent
            work, num_bytes = in_flight.popleft()
            self._wait(work, receive, sent)
            sent += num_bytes

        with torch.no_grad():
            for segments in segments_per_bucket:
                for segment in segments:
                    segment_specs = specs[segment.start : segment.stop]
                    segment_tensors = [next(tensors) for _ in segment_specs]
                    for spec, tensor in zip(segment_specs, segment_tensors):
                        _check_shape(spec, tensor)
                    for payload, region in self._segment_payloads(segment_specs, segment_tensors, ring, wait_oldest):
                        if receive.done():
                            receive.result(0)  # the workers failed: say why instead of sending on
                        work = post_broadcast(self._group, payload)
                        in_flight.append((work, payload.numel()))
                        if region is not None:
                            ring.hold(region, work)
            while in_flight:
                wait_oldest()

    def _wait(self, work: Any, receive: BackgroundCall[None], sent: int) -> None:
        """Wait for one broadcast, failing early if the workers' update call fails first."""
        deadline = time.monotonic() + self.timeout_seconds
        try:
            while not work.is_completed():
                if receive.done():
                    receive.result(0)
                if time.monotonic() > deadline:
                    raise WeightSyncTimeoutError(
                        f"A broadcast to vLLM did not finish within {self.timeout_seconds:g} s after {sent} bytes. "
                        "The engine may have stopped; re-initialise the updater (init) once it is back."
                    )
                time.sleep(_WORK_POLL_SECONDS)
            work.wait()
        except WeightSyncError:
            raise  # already says what happened (a timeout stays a WeightSyncTimeoutError)
        except RuntimeError as error:
            if receive.done():
                receive.result(0)
            raise WeightSyncError(
                f"Sending weights to vLLM failed after {sent} bytes: {error}. The engine may have "
                "stopped; re-initialise the updater (init) once it is back."
            ) from error

    def _segment_payloads(
        self,
        specs: Sequence[TensorSpec],
        tensors: Sequence[torch.Tensor],
        ring: StagingRing,
        make_room: Callable[[], None],
    ) -> Iterator[tuple[torch.Tensor, tuple[int, int] | None]]:
        """The uint8 tensors to send for one segment, with the ring region each one uses (if any).

        A lone tensor already in the wire dtype is sent from its own memory.
        """
        if len(tensors) == 1 and _is_wire_ready(tensors[0], specs[0]):
            data = tensors[0].reshape(-1).view(torch.uint8)  # sent from the source's memory, no copy
            for begin in range(0, data.numel(), self.bucket_size_bytes):
                yield data[begin : begin + self.bucket_size_bytes], None
            return
        if len(tensors) == 1:  # converted slice by slice, so a huge tensor needs one bucket at most
            spec, flat = specs[0], tensors[0].reshape(-1)
            per_slice = self.bucket_size_bytes // spec.dtype.itemsize
            for begin in range(0, flat.numel(), per_slice):
                part = flat[begin : begin + per_slice]
                region, staging = ring.take(part.numel() * spec.dtype.itemsize, make_room)
                staging.view(spec.dtype).copy_(part)  # converts to the wire dtype on the way
                yield staging, region
            return
        region, staging = ring.take(sum(spec.num_bytes for spec in specs), make_room)
        offset = 0
        for spec, tensor in zip(specs, tensors):
            staging[offset : offset + spec.num_bytes].view(spec.dtype).view(spec.shape).copy_(tensor)
            offset += spec.num_bytes
        yield staging, region

    @override
    def shutdown(self) -> None:
        """Leave the group; the workers' side is released by the client's
        ``shutdown_weight_transfer_engine`` (the updater calls it)."""
        self._group = None
        self._store = None
        self._staging = None


def _is_wire_ready(tensor: torch.Tensor, spec: TensorSpec) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == spec.dtype and tensor.is_contiguous()


def _check_shape(spec: TensorSpec, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"Tensor {spec.name!r} has shape {tuple(tensor.shape)} but the sync was planned for {spec.shape}; "
            "the weights changed shape since the metadata was taken."
        )
