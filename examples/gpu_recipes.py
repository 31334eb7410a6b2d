"""The GPU recipes of docs/gpu.md ("Recipes"), as data: the engine and callback arguments for GRPO on Qwen3-8B and on
Qwen3-30B-A3B, full fine-tuning, on nodes of 8 H100s (80 GB each). docs/gpu.md quotes them, and its test holds the
quote to these; ``make test-gpu-recipes`` pushes at each model's real layer shape into an engine started with them.

Each recipe gives the ``vllm.LLM`` (or ``vllm serve``) arguments of its engine, the GPUs the engine takes, the
callback's arguments and the Trainer's. Use one as::

    from examples.gpu_recipes import QWEN3_8B
    sync = VLLMWeightSync(engine=QWEN3_8B.engine, engine_gpus=QWEN3_8B.engine_gpus, **QWEN3_8B.callback)
    trainer = Trainer(callbacks=[sync], **QWEN3_8B.trainer)  # and strategy=ModelParallelStrategy(...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recipe:
    """One model's set-up.

    Attributes:
        engine: the ``vllm.LLM`` arguments (for ``vllm serve``, the same as flags).
        engine_gpus: the GPUs of the trainer's first node the callback starts the engine on (empty: the engine is a
            ``vllm serve`` of its own, on ``servers``).
        servers: the engines' URLs when they are ``vllm serve`` processes on another node.
        serve_gpus: each server's ``CUDA_VISIBLE_DEVICES`` on its node.
        callback: ``VLLMWeightSync``'s other arguments.
        trainer: ``Trainer``'s arguments (its strategy: FSDP2 through ``ModelParallelStrategy``).
        layer: the model's layer shape (its Hugging Face config, less the number of layers): what the GPU tier
            builds.
    """

    engine: dict[str, Any]
    callback: dict[str, Any]
    trainer: dict[str, Any]
    layer: dict[str, Any]
    engine_gpus: tuple[int, ...] = ()
    servers: tuple[str, ...] = ()
    serve_gpus: tuple[str, ...] = field(default=())


QWEN3_8B = Recipe(
    engine={
        "model": "Qwen/Qwen3-8B",
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.75,
        "enable_prefix_caching": True,
    },
    engine_gpus=(6, 7),  # tensor_parallel_size=2, lightning_nccl: the callback's defaults for placed engines
    callback={"every_n_train_steps": 1, "max_staleness": 0},
    trainer={"accelerator": "gpu", "devices": [0, 1, 2, 3, 4, 5], "precision": "bf16-mixed"},
    layer={
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
    },
)  # fmt: skip
"""Qwen3-8B on one node: FSDP2 over GPUs 0-5 (16 bytes a parameter of weights, gradients and AdamW states in
float32: 131 GB, 22 GB a GPU, plus activations), the engine on GPUs 6 and 7 (8.2 GB of bf16 weights on each, the
staging room as much again, outside vLLM's 0.75)."""

QWEN3_30B_A3B = Recipe(
    engine={
        "model": "Qwen/Qwen3-30B-A3B",
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.6,
        "tensor_parallel_size": 4,
        "enable_prefix_caching": True,
        "weight_transfer_config": {"backend": "lightning_nccl"},
    },
    servers=("http://engines:8000", "http://engines:8001"),
    serve_gpus=("0,1,2,3", "4,5,6,7"),
    callback={"every_n_train_steps": 1, "max_staleness": 0, "master_address": "trainer0"},
    trainer={"accelerator": "gpu", "devices": 8, "num_nodes": 2, "precision": "bf16-mixed"},
    layer={
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
    },
)  # fmt: skip
"""Qwen3-30B-A3B on three nodes: FSDP2 over the 16 GPUs of two (30.5B parameters at 16 bytes: 488 GB, 30.5 GB a
GPU, plus activations), two ``vllm serve`` engines on the third, four GPUs each (15.3 GB of bf16 weights a GPU, the
staging room as much again, outside vLLM's 0.6). ``engines`` and ``trainer0`` are the nodes' addresses."""

RECIPES = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
