"""Random Qwen2-shaped models at the sizes the benchmarks measure (no model hub needed), and how the
benchmarks' trainers shard a model with FSDP2.

Shapes follow Qwen2's proportions (tied embeddings, grouped-query attention with two
key/value heads, head size 64, which vLLM's CPU attention supports), scaled down to
fit a 2-core machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


@dataclass(frozen=True)
class ModelSize:
    """One benchmarked model: a name for the report and the Qwen2 dimensions."""

    name: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int = 2

    def config(self) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.hidden_size // 64,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
        )


SIZES = {
    "25M": ModelSize("25M", hidden_size=512, num_layers=6, intermediate_size=1536, vocab_size=12288),
    "100M": ModelSize("100M", hidden_size=768, num_layers=12, intermediate_size=2304, vocab_size=32000),
    "200M": ModelSize("200M", hidden_size=1024, num_layers=14, intermediate_size=3072, vocab_size=32000),
    "400M": ModelSize("400M", hidden_size=1024, num_layers=24, intermediate_size=3584, vocab_size=65536),
}
# 28 layers of 12 tensors: per-call overhead dominates, as in a deep model with small layers.
MANY_TENSORS = ModelSize(
    "many-tensors", hidden_size=128, num_layers=28, intermediate_size=256, vocab_size=512, num_key_value_heads=1
)


def build_model(size: ModelSize, seed: int = 0) -> Qwen2ForCausalLM:
    """A bfloat16 model with random weights, in eval mode."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(size.config()).to(torch.bfloat16).eval()


def num_parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def save(model: Qwen2ForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def fully_shard_layers(model: torch.nn.Module, mesh: Any) -> None:
    """Shard a Hugging Face causal LM with FSDP2 over ``mesh``: each decoder layer, then the whole model (its
    embeddings, final norm and head), as a trainer wraps it (``sharded_memory.py``, ``multihost_node.py``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
