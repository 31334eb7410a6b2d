"""Worker side of the *floor* measurement, added to vLLM's worker with ``worker_extension_cls``.

The floor is what no CPU sync can beat: the bytes of one sync through the raw
transport, with no packing and no per-bucket loading, followed by vLLM's own
in-memory ``reload_weights`` of the very tensors received. vLLM adds the methods of
this class to its worker, so the trainer calls them by name with ``collective_rpc``.
"""

from __future__ import annotations

import time
from typing import Any

from lightning_vllm.engines.worker_check import WeightCheckExtension


class FloorWorkerExtension(WeightCheckExtension):
    """Methods vLLM mixes into its worker (``self`` is the worker); with lightning_vllm's own, so that
    ``checked`` pushes are checked (``verify_pushes=True``) as a user's are."""

    weight_transfer_engine: Any

    def benchmark_floor_receive(self, update_info: dict[str, Any]) -> dict[str, float]:
        """Receive every tensor of ``update_info`` first, then reload them all at once.

        Returns the seconds spent in each part. Uses the gloo group the trainer set up
        with ``init_weight_transfer_engine``.
        """
        engine = self.weight_transfer_engine
        start = time.perf_counter()
        segments = engine.receiver.post_update(engine.parse_update_info(update_info)).arrived()
        received = [tensor for segment in segments for tensor in segment]
        transported = time.perf_counter()
        self.reload_weights(weights_iterator=iter(received), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"transport_seconds": transported - start, "load_seconds": time.perf_counter() - transported}

    def benchmark_streaming_receive(self, update_info: dict[str, Any]) -> None:
        """Load each segment as soon as it lands, under one layer-wise reload.

        The gloo worker's design before atomic updates: it overlaps loading with
        receiving, but a transfer that breaks half way leaves the model half updated.
        Timed against ours, it is what atomicity costs.
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from lightning_vllm.backends.gloo.tied_embedding_fix import tied_embeddings_refreshed

        engine = self.weight_transfer_engine
        with tied_embeddings_refreshed(engine.model):
            initialize_layerwise_reload(engine.model)
            for tensors in engine.receiver.post_update(engine.parse_update_info(update_info)).arrived():
                engine.model.load_weights(tensors)
            finalize_layerwise_reload(engine.model, engine.model_config)
