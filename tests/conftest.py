"""Shared fixtures: real vLLM engines are slow to start (~20 s), so tests share them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import LORA_ENGINE, build_llm, save_model, shutdown, tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 saved with save_pretrained: what vLLM loads at start."""
    return save_model(tiny_qwen2(seed=0), tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def llm(model_dir: Path):
    """A real vLLM engine (multiprocess engine core) with the gloo weight-transfer backend."""
    engine = build_llm(model_dir, backend="gloo", worker_extension_cls="worker_probe.WorkerProbe", **LORA_ENGINE)
    yield engine
    shutdown(engine)
