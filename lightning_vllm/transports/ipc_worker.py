"""``lightning_ipc``: vLLM's CUDA-IPC worker engine, loading a push with one copy.

vLLM's own ``ipc`` engine loads every push through its layer-wise reload
(``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``): each layer is rebuilt on
the meta device, materialized again, loaded, processed and copied back into the tensors
vLLM's CUDA graphs point at, so a push makes two copies and much Python work per tensor, and
every push opens each CUDA IPC handle again. Measured on an H200 (docs/gpu.md), an 8B push
took 20× one device-to-device copy of its bytes, almost all inside the worker.

This engine is vLLM's, with two changes:

- **One copy.** When the model's weights are used as loaded (no quantization, no MLA, the
  KV cache in the model's dtype, a CUDA GPU: vLLM processes nothing after loading then),
  the model's own weight loaders copy each tensor straight into the parameter it belongs
  to, the fused q/k/v and gate/up included. Otherwise it loads as vLLM's engine does.
- **Handles opened once.** The tensors of a push stay referenced until the next push has
  opened its own, so PyTorch's CUDA IPC cache hands back the mapping of a storage the
  trainer still holds instead of opening it again (an optimizer step writes in place).
  They pin nothing new: the trainer's parameters are there anyway.

The check after every push (``verify_pushes``) holds what the workers then hold against what
was sent, layer by layer. Build the engine with
``weight_transfer_config={"backend": "lightning_ipc"}``; the trainer's side is vLLM's IPC
engine, unchanged (``backends/ipc.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo


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
    """vLLM's ``IPCWeightTransferEngine`` that loads with one copy and keeps its handles open (see the
    module docstring); vLLM builds it for ``weight_transfer_config={"backend": "lightning_ipc"}``."""

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.in_place = loads_as_held(vllm_config)
        self._opened: list[torch.Tensor] = []  # the last push's tensors: their storages stay mapped

    def start_weight_update(self) -> None:
        if not self._loads_in_place():
            super().start_weight_update()

    def finish_weight_update(self) -> None:
        if self._loads_in_place():
            self._packed_importer.close()  # as vLLM's engine does: the trainer may reuse its buffer
        else:
            super().finish_weight_update()

    def _loads_in_place(self) -> bool:
        # A speculative draft model is another target, loaded vLLM's way.
        return self.in_place and self.model is self._default_model

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        if self.packed:
            super().receive_weights(update_info)
            return
        assert isinstance(update_info.ipc_handles, list)
        device_index = self.device.index
        gpu_id = str(torch.cuda.get_device_properties(device_index).uuid)
        weights = []
        for name, handle in zip(update_info.names, update_info.ipc_handles):
            if gpu_id not in handle:
                raise ValueError(f"IPC handle not found for GPU UUID {gpu_id}. Available UUIDs: {list(handle)}")
            args = list(handle[gpu_id])
            args[6] = device_index  # the device index, as this worker numbers its GPUs (vLLM does the same)
            weights.append((name, rebuild_cuda_tensor(*args)))
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check(), torch.no_grad():
            self.model.load_weights(weights)  # type: ignore[operator]  # a vLLM model, not a bare Module
        # Kept until the next push has opened its own: a storage still mapped here is found in PyTorch's
        # cache instead of being opened again.
        self._opened = [tensor for _, tensor in weights]

    def shutdown(self) -> None:
        self._opened = []
        super().shutdown()
