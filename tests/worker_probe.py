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

    def add_to_parameter(self, name: str, amount: float) -> float:
        """Add ``amount`` to the first element of vLLM's parameter ``name`` behind the trainer's back (a
        corrupted layer, as a faulty load would leave it); returns the element's new value."""
        parameter = dict(self.get_model().named_parameters())[name]  # type: ignore[attr-defined]
        with torch.no_grad():
            parameter.view(-1)[0] += amount
        return float(parameter.view(-1)[0])
