"""A bf16 model of Qwen2.5-1.5B's shape pushed over ipc into vLLM's own engine, started from dummy weights: after
every push the engine holds exactly the trainer's weights (``scenarios.every_bf16_push_lands_exactly``)."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.gpu


def test_every_push_of_a_1_5b_bf16_model_lands_exactly(tmp_path, insecure_serialization):
    scenarios.every_bf16_push_lands_exactly(tmp_path, backend="ipc")
