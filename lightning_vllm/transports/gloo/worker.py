"""Worker half of the ``gloo`` backend: what vLLM builds inside each of its workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from lightning_vllm.transports.gloo.messages import GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo
from lightning_vllm.transports.gloo.receiver import GlooReceiver, NamedTensors
from lightning_vllm.transports.gloo.tied_embedding_fix import refresh_tied_embeddings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives buckets over gloo and loads them into vLLM's model.

    vLLM builds it when the engine was created with
    ``weight_transfer_config={"backend": "gloo"}``, and calls, in order:
    ``init_transfer_engine`` once (joins the group; blocks until the trainer and
    every other worker have joined), then for each sync ``start_weight_update``
    (starts layer-wise reload), ``receive_weights`` (blocks on the trainer's
    broadcasts) and ``finish_weight_update`` (re-processes layers).
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: GlooReceiver | None = None

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

        if self.receiver is None:
            raise RuntimeError("The gloo weight transfer is not initialised: call init_weight_transfer_engine first.")
        with disable_mtp_completeness_check():
            for tensors in self.receiver.received_segments(update_info):
                self.model.load_weights(self._on_device(tensors))  # type: ignore[operator]  # every vLLM model has it

    def _on_device(self, tensors: NamedTensors) -> NamedTensors:
        if self.device.type == "cpu":
            return tensors
        return [(name, tensor.to(self.device)) for name, tensor in tensors]

    @override
    def shutdown(self) -> None:
        self.receiver = None  # frees the group and the kept receive buffers
