"""What is sent: the Hugging Face model's weights, named, typed and checked for vLLM."""

from lightning_vllm.weights.checks import ExpectedWeights, check_weights, checkpoint_weights, metadata_problems
from lightning_vllm.weights.model import ModelMetadata, canonical_name, find_hf_model, unwrap
from lightning_vllm.weights.sources import (
    DeclaredWeights,
    EngineWeights,
    LoraMergedWeights,
    MappingWeights,
    ModuleWeights,
    source_metadata,
    weights_from,
)

__all__ = [
    "DeclaredWeights",
    "ExpectedWeights",
    "LoraMergedWeights",
    "MappingWeights",
    "ModelMetadata",
    "ModuleWeights",
    "canonical_name",
    "check_weights",
    "checkpoint_weights",
    "find_hf_model",
    "metadata_problems",
    "source_metadata",
    "unwrap",
    "EngineWeights",
    "weights_from",
]
