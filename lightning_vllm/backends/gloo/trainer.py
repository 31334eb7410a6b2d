"""Trainer half of the ``gloo`` backend: a sync laid out in buckets, and its broadcasts."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import torch
from typing_extensions import Self, override
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.backends.base import Sender
from lightning_vllm.backends.gloo.group import SendWindow, StagingRing, Wire, segment_payloads
from lightning_vllm.backends.gloo.messages import (
    DEFAULT_COALESCE_BYTES,
    GlooTrainerInitInfo,
    GlooWeightTransferUpdateInfo,
    Segment,
    TensorSpec,
    choose_segment_ends,
    cut_into_buckets,
)
from lightning_vllm.backends.gloo.rendezvous import form_group
from lightning_vllm.backends.gloo.shares import send_in_shares
from lightning_vllm.engines.client import TimedClient
from lightning_vllm.errors import WeightSyncTimeoutError
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_TIMEOUT_SECONDS
from lightning_vllm.weights.base import ForeignWeights, Weights
from lightning_vllm.weights.payload import Outgoing

log = logging.getLogger(__name__)


def send_order(source: Weights) -> list[list[TensorSpec]]:
    """The source's tensors as layer groups, in the order ``iter_groups`` yields them."""
    by_name = {meta.name: TensorSpec(meta.name, meta.dtype, tuple(meta.shape)) for meta in source.metadata}
    return [[by_name[name] for name in group] for group in source.groups()]


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo], Sender):
    """Drives a sync from the trainer: vLLM's four-phase handshake plus the gloo broadcasts; our connection's
    :class:`~lightning_vllm.backends.base.Sender` as it is.

    Built with :meth:`trainer_init` (which returns once every worker has joined)
    and used with :meth:`send_weights`, which replays the ``source`` attribute (as
    vLLM's own trainer engines do). Non-sender trainer ranks (rank > 0) hold no
    group and only iterate the source, so that collective gathers inside it (FSDP
    ``full_tensor()``) stay aligned across ranks.

    Example::

        >>> engine = GlooTrainerWeightTransferEngine.trainer_init(  # doctest: +SKIP
        ...     GlooTrainerInitInfo(world_size=2), client=LocalLLMEngine(llm), source=weights_from(model))
        >>> engine.send_weights()  # doctest: +SKIP
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
        self.coalesce_bytes = DEFAULT_COALESCE_BYTES
        self.address: str | None = None
        self.port: int | None = None
        self._group: Wire | None = None
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
            engine._group, engine.port = form_group(init_info, engine.client)
            engine.address = init_info.master_address
        return engine

    @override
    def send_weights(self) -> None:
        """vLLM's entry point: send ``self.source`` through ``self.client`` (see :meth:`send`)."""
        if self.source is None:
            raise ValueError("No weights to send: pass a WeightSource to trainer_init.")
        source = self.source if isinstance(self.source, Weights) else ForeignWeights(self.source)
        self.send(Outgoing(source, self.client))

    @override
    def send(self, outgoing: Outgoing) -> None:  # (the push has landed when it returns)
        """Send every tensor of ``outgoing.weights`` and load it in vLLM, between start and finish.

        Our connection calls this with each push's own weights and client (whose
        ``finish_weight_update`` commits the version), so nothing of one push is left on
        the engine object for the next. ``outgoing.adapter`` is the LoRA adapter among the
        tensors, as the workers are told (``GlooWeightTransferUpdateInfo``).

        With ``outgoing.every_rank``, the weights are rank 0's shares (``weights/shares.py``) and every
        other trainer rank sends its own at the same time (``shares.send_in_shares``).

        Blocks until the workers have loaded the weights and finished the update,
        each wait bounded by ``timeout_seconds``.
        """
        source, client, every = outgoing.weights, outgoing.client, outgoing.every_rank
        groups = send_order(source)
        tensors = (tensor for _, batch in source.iter_groups() for tensor in batch)
        if not self.is_sender:
            for _ in tensors:  # stay in step with the sender's collective gathers
                pass
            return
        wire = self._connected_group()  # before the engine starts an update it could not finish
        self._start_update(client)
        if groups and every is not None:
            send_in_shares(self, wire, groups, tensors, client, every, fingerprinted=outgoing.checked)
        elif groups:  # (nothing changed since the last push: only the version moves)
            self.send_update(groups, tensors, adapter=outgoing.adapter, client=client, fingerprinted=outgoing.checked)
        client.finish_weight_update()

    def _start_update(self, client: Any) -> None:
        """Start an update, closing first one that a stopped trainer left open.

        vLLM refuses to start an update while another is open, and a trainer killed
        between its start and finish calls leaves one open. On the gloo engine a finish
        with nothing received loads nothing and commits no version, so it is a safe way
        to close it; if it does not help, the first error is what is raised.
        """
        client = client if isinstance(client, TimedClient) else TimedClient(client, self.timeout_seconds)
        try:
            client.start_weight_update()
        except WeightSyncTimeoutError:
            raise
        except Exception as error:
            try:
                client.close_open_update()
            except Exception:
                raise error from None
            log.warning("Closed a weight update left open by an earlier trainer (%s); starting a new one.", error)
            client.start_weight_update()

    def send_update(
        self,
        groups: Sequence[Sequence[TensorSpec]],
        tensors: Iterator[torch.Tensor],
        adapter: dict[str, Any] | None = None,
        client: Any = None,
        fingerprinted: bool = True,
    ) -> None:
        """One ``update_weights`` call and the broadcasts that carry its tensors.

        Must run between the client's ``start_weight_update`` and
        ``finish_weight_update`` (:meth:`send_weights` does all three); callers
        that drive the phases themselves may send a sync in several updates.
        Blocks until the workers have loaded the tensors (``timeout_seconds``).

        Args:
            groups: the tensor specs, one list per layer group, in send order.
            tensors: the tensors of ``groups``, in the same order.
            adapter: the LoRA adapter among them, if any (see ``GlooWeightTransferUpdateInfo``).
            client: the engine's client (default: ``self.client``).
            fingerprinted: the workers fingerprint what they load, for the check after the push
                (``GlooWeightTransferUpdateInfo``).
        """
        process_group = self._connected_group()
        specs = [spec for group in groups for spec in group]
        buckets = cut_into_buckets(groups, self.bucket_size_bytes)
        segment_ends = choose_segment_ends(specs, buckets, min(self.coalesce_bytes, self.bucket_size_bytes))
        update_info = GlooWeightTransferUpdateInfo.from_buckets(specs, buckets, segment_ends, adapter, fingerprinted)
        client = self.client if client is None else client
        receive = BackgroundCall(client.update_weights, asdict(update_info), what="vLLM workers to load the weights")
        segments = [update_info.segments(specs, bucket) for bucket in buckets]
        self._send_segments(process_group, specs, segments, tensors, receive)
        receive.result(self.timeout_seconds)

    def _connected_group(self) -> Wire:
        if self._group is None:
            raise RuntimeError("The gloo trainer engine is not connected: build it with trainer_init.")
        return self._group

    def _send_segments(
        self,
        group: Wire,
        specs: Sequence[TensorSpec],
        segments_per_bucket: Sequence[Sequence[Segment]],
        tensors: Iterator[torch.Tensor],
        receive: BackgroundCall[None],
    ) -> None:
        """Post broadcasts ahead of their completion, then wait for them all.

        Copies (packed small tensors, dtype conversions) go through the staging ring,
        which bounds them to one bucket; a ring region is reused only once the
        broadcast that reads it has finished. The other payloads are the source's own
        memory, which a broadcast keeps alive until it ends: at most one bucket is in
        flight, so a source that gathers (a sharded policy) holds one layer group
        plus one bucket beyond its shard. Every broadcast ends before this returns.
        """
        if self._staging is None:
            self._staging = StagingRing(self.bucket_size_bytes)
        ring = self._staging
        ring.reset()
        window = SendWindow(group, self.bucket_size_bytes, self.timeout_seconds, receiving=receive)
        with torch.no_grad():
            for segments in segments_per_bucket:
                for segment in segments:
                    segment_specs = specs[segment.start : segment.stop]
                    segment_tensors = [next(tensors) for _ in segment_specs]
                    for spec, tensor in zip(segment_specs, segment_tensors):
                        _check_shape(spec, tensor)
                    for payload, region in segment_payloads(
                        segment_specs, segment_tensors, ring, self.bucket_size_bytes, window.wait_oldest
                    ):
                        window.raise_if_receiving_failed()  # (the workers failed: say why instead of sending on)
                        transfer = window.post(payload)
                        if region is not None:
                            ring.hold(region, transfer)
            window.finish()

    @override
    def shutdown(self) -> None:
        """Close the connections and the listener; the workers' side is released by the
        client's ``shutdown_weight_transfer_engine`` (the updater calls it)."""
        if self._group is not None:
            self._group.close()
        self._group = None
        self._staging = None


def _check_shape(spec: TensorSpec, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"Tensor {spec.name!r} has shape {tuple(tensor.shape)} but the sync was planned for {spec.shape}; "
            "the weights changed shape since the metadata was taken."
        )
