"""vLLM's own engine on the GPU host, and the model pushed into it: what the benchmarks that push into a real
``vllm.LLM`` share (``ipc_push.py``, ``moe_ipc_push.py``, ``nccl_check.py``, ``nccl_push.py``, ``background_stall.py``).

Importing it puts ``tests/`` and ``tests/gpu/`` on the path: the engine and the digests are the GPU tier's
(``tests/gpu/gpu_helpers.py``), so a figure here is measured on the engine the tier checks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

LLAMA_3_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    tie_word_embeddings=False,
)  # fmt: skip
"""Llama-3-8B's shape (8.03 B parameters, 16.1 GB in bfloat16, untied embeddings): the model :func:`build_model`
pushes into vLLM's own engine."""


def allow_pickled_rpc() -> None:
    """Let vLLM's RPC carry pickles (the IPC handles, the functions the benchmarks run in vLLM's worker); set
    before the engine starts, which reads it."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def build_model(model_dir: Path, shape: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """Llama-3-8B's shape (or another Llama ``shape``) in bf16 on the GPU, random weights; its config saved to
    ``model_dir`` for vLLM (``gpu_helpers.bf16_model_on_gpu``)."""
    from gpu_helpers import bf16_model_on_gpu
    from transformers import LlamaConfig

    config = LlamaConfig(**(shape or LLAMA_3_8B), architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    return bf16_model_on_gpu(config, model_dir)


def dummy_llm(model_dir: Path, backend: str = "ipc", gpu_memory_utilization: float = 0.3) -> Any:
    """A real ``vllm.LLM`` of the bf16 model whose config is in ``model_dir``, from dummy weights, over ``backend``,
    with the GPU tier's engine settings (``gpu_helpers.gpu_llm``) and room for a few short sequences."""
    from gpu_helpers import gpu_llm

    return gpu_llm(
        model_dir,
        backend=backend,
        dtype="bfloat16",
        load_format="dummy",
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=256,
        max_num_seqs=4,
    )


def landed_exactly(llm: Any, model: torch.nn.Module) -> bool:
    """Whether the engine's parameters equal the trainer's (float64 digests, each computed on its own GPU)."""
    from gpu_helpers import digests_equal, engine_digest, model_digest

    return digests_equal(engine_digest(llm), model_digest(model))
