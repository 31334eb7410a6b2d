"""Test-only methods added to vLLM's worker (``worker_extension_cls``) to look inside the gloo engine."""

from __future__ import annotations

from typing import Any


class WorkerProbe:
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
