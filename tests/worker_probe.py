"""Test-only methods added to vLLM's worker (``worker_extension_cls``) to look inside the gloo engine.

It extends lightning_vllm's own worker extension, as a user's extension would, so that the shared
test engine's pushes are checked (``verify_pushes``).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vllm.engines.worker_check import WeightCheckExtension


class WorkerProbe(WeightCheckExtension):
    """vLLM mixes these methods into its worker; tests call them with ``llm.collective_rpc``."""

    weight_transfer_engine: Any

    def scribble_on_receive_buffers(self) -> int:
        """Overwrite every kept receive buffer with 0xFF bytes (NaN in float32); returns how many bytes.

        If vLLM still referred to any of them after a sync, the engine's outputs would change.
        """
        buffers = self.weight_transfer_engine.receiver.kept_buffers
        for buffer in buffers:
            buffer.fill_(255)
        return sum(buffer.numel() for buffer in buffers)

    def online_fingerprints_ready(self) -> bool:
        """Whether vLLM's online quantization is wrapped in this worker (``weights/online_sums.py``), as our plugin's
        worker wrapper does before the model is loaded."""
        from vllm.model_executor.model_loader import utils

        return bool(getattr(utils.online_quantization_timing_context, "_lightning_vllm_fingerprinted", False))

    def add_to_parameter(self, name: str, amount: float) -> float:
        """Add ``amount`` to the first element of vLLM's parameter ``name`` behind the trainer's back (a
        corrupted layer, as a faulty load would leave it); returns the element's new value."""
        parameter = dict(self.get_model().named_parameters())[name]  # type: ignore[attr-defined]
        with torch.no_grad():
            parameter.view(-1)[0] += amount
        return float(parameter.view(-1)[0])

    def flip_at_next_load(self, module_name: str) -> None:
        """At the next load that processes vLLM's layer ``module_name``, once: negate one value the loader has just
        copied into it, then process it as usual (vLLM's CPU build packs it for oneDNN there)."""
        layer = self.get_model().get_submodule(module_name)  # type: ignore[attr-defined]
        layer = getattr(layer, "base_layer", layer)  # (an engine serving LoRA wraps its linear layers)
        method = layer.quant_method
        process = method.process_weights_after_loading

        def flipped_then_processed(module: torch.nn.Module) -> None:
            if module is layer:
                del method.process_weights_after_loading  # (once: the class's own again)
                with torch.no_grad():
                    module.weight.view(-1)[0].neg_()
            return process(module)

        method.process_weights_after_loading = flipped_then_processed

    def leave_tied_packs_stale_once(self) -> None:
        """At the next update, load as vLLM 0.32's own reload does: the output embedding tied to the input
        embedding keeps the oneDNN pack of its old values (``backends/gloo/tied_embedding_fix.py`` is skipped)."""
        from contextlib import contextmanager

        from lightning_vllm.backends.gloo import worker

        refresh = worker.tied_embeddings_refreshed

        @contextmanager
        def left_stale(model: torch.nn.Module) -> Any:
            worker.tied_embeddings_refreshed = refresh  # (once)
            yield

        worker.tied_embeddings_refreshed = left_stale
