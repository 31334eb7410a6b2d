"""TorchRL's documented weight-sync-scheme usage, with ``lightning_vllm.torchrl`` imported in place of TorchRL's, into
vLLM's own engine on the GPU over ``lightning_ipc``, an ``LLMCollector`` sampling from it
(``torchrl_scheme_checks.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from torchrl_scheme_checks import assert_the_scheme_keeps_vllm_and_the_collector_in_step

pytestmark = pytest.mark.gpu

pytest.importorskip("torchrl", reason="the torchrl extra (make test installs it)")


def test_torchrls_documented_scheme_usage_over_lightning_ipc(lightning_ipc_llm: Any) -> None:
    assert_the_scheme_keeps_vllm_and_the_collector_in_step(lightning_ipc_llm, "lightning_ipc")
