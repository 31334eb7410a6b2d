"""Worker half of the ``gloo`` backend: what vLLM builds inside each of its workers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from lightning_vllm.backends.gloo.messages import GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo
from lightning_vllm.backends.gloo.moe_prepack_fix import cpu_experts_repacked
from lightning_vllm.backends.gloo.receiver import GlooReceiver, NamedTensors, PostedUpdate
from lightning_vllm.backends.gloo.tied_embedding_fix import tied_embeddings_refreshed
from lightning_vllm.in_vllm.lora_adapters import ADAPTER_PREFIX, ReceivedAdapter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives a whole update from the trainer while vLLM serves, then loads it in one call.

    vLLM builds it when the engine was created with
    ``weight_transfer_config={"backend": "gloo"}``, and calls, in order:
    ``init_transfer_engine`` once (joins the group; blocks until the trainer and
    every other worker have joined), then for each sync ``start_weight_update``
    (opens an empty update), ``update_weights`` (posts the receives and returns at
    once: the connection's thread takes the bytes into kept buffers while the engine goes on
    generating with the weights it has) and ``finish_weight_update`` (waits for every
    byte, then loads the whole update under layer-wise reload).

    The model is touched only inside ``finish_weight_update``, one engine-core call
    that no generation step can interleave with: an engine serves the old weights or
    the new ones, never a mix, and a trainer that stops before that call leaves the
    model as it was. A finish with nothing received is a no-op; the updater uses it to
    close an update a stopped trainer left open.

    An update may carry a LoRA adapter (``update_info.adapter``): it is checked against
    the engine before anything is loaded, then, after any base weights of the same
    update, staged on this host for vLLM's LoRA loader (``in_vllm/lora_adapters.py``).
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: GlooReceiver | None = None
        self.pending: PostedUpdate | None = None

    def worker_rank(self, rank_offset: int) -> int:
        """This worker's rank in the transfer group, unique across data-parallel replicas."""
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank + rank_offset

    @override
    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        self.receiver = GlooReceiver(init_info, rank=self.worker_rank(init_info.rank_offset))

    @override
    def start_weight_update(self) -> None:
        self._drop_pending()  # an update a stopped trainer left half-received is dropped, never loaded

    def _drop_pending(self) -> None:
        if self.pending is not None:
            self.pending.close()
        self.pending = None

    @override
    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would call torch.accelerator.synchronize() after a blocking
        # receive; here the receive is only posted.
        self.receive_weights(self.parse_update_info(update_info))

    @override
    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("The gloo weight transfer is not initialised: call init_weight_transfer_engine first.")
        self.pending = self.receiver.post_update(update_info, into=self.pending)

    @override
    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        # (Imported at the first update, as the check's worker method is at its first call: a worker that is never
        # updated loads nothing of lightning_vllm.weights.)
        from lightning_vllm.weights.packed_sums import packing_fingerprinted

        if not self.pending:  # none, or one that received nothing
            self._drop_pending()
            return
        pending, self.pending = self.pending, None
        received = pending.wait()  # raises before the model is touched if any byte is missing
        adapter = None
        if pending.adapter is not None:  # checked before anything is loaded
            adapter_tensors = {name: t for batch in received for name, t in batch if name.startswith(ADAPTER_PREFIX)}
            adapter = ReceivedAdapter(self.model, self.vllm_config, pending.adapter, adapter_tensors)
            received = [[(name, t) for name, t in batch if not name.startswith(ADAPTER_PREFIX)] for batch in received]
        if any(received):
            # (What vLLM's CPU build packs is fingerprinted as it packs it if the push is checked: the check reads it.)
            fingerprinted = packing_fingerprinted(pending.fingerprinted)
            with fingerprinted, tied_embeddings_refreshed(self.model), cpu_experts_repacked(self.model):
                initialize_layerwise_reload(self.model)
                with disable_mtp_completeness_check():
                    for tensors in received:
                        if tensors:
                            self.model.load_weights(self._on_device(tensors))  # type: ignore[operator]  # all vLLM models
                with _layers_left_out_on_purpose():
                    finalize_layerwise_reload(self.model, self.model_config)
        if adapter is not None:
            adapter.save()  # vLLM drops loaded adapters after each update and loads this one at its next request

    def _on_device(self, tensors: NamedTensors) -> NamedTensors:
        if self.device.type == "cpu":
            return tensors
        return [(name, tensor.to(self.device)) for name, tensor in tensors]

    @override
    def shutdown(self) -> None:
        self._drop_pending()
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None  # frees the kept receive buffers


def _not_left_out_on_purpose(record: logging.LogRecord) -> bool:
    """Drops layer-wise reload's "Failed to load weights" warning, which it logs for every layer that
    received nothing: layers without checkpoint weights (rotary embeddings) at every update, and the
    layers a changed-only push leaves out because the engine holds them already. Such a layer keeps
    its weights; the trainer checked the names of every update before sending it."""
    return "Failed to load weights" not in record.getMessage()


@contextmanager
def _layers_left_out_on_purpose() -> Iterator[None]:
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_log.addFilter(_not_left_out_on_purpose)
    try:
        yield
    finally:
        reload_log.removeFilter(_not_left_out_on_purpose)
