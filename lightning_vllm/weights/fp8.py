"""Block-wise FP8, the way an engine started from an FP8 checkpoint holds its linear layers: what the trainer sends it.

Qwen3-8B-FP8's layout (``quantization_config.weight_block_size=[128, 128]``, vLLM's ``Fp8LinearMethod``): each
quantized ``X.weight`` is ``float8_e4m3fn`` beside a ``float32`` ``X.weight_scale_inv`` with one scale per 128 x 128
block (a partial block at each edge); embeddings, norms and ``lm_head`` stay in the serving dtype. The trainer trains
in bf16 and quantizes each such weight on its own device as it sends it (:func:`block_fp8`, bit for bit vLLM's
``per_block_cast_to_fp8``, which vLLM's online ``fp8_per_block`` also applies at load), so half the bytes move.

Which tensors are quantized is the engine's word, not ours: its checkpoint names an ``X.weight`` in FP8 beside an
``X.weight_scale_inv`` (:func:`block_fp8_plan`). The check before a push compares names, shapes and dtypes in that
form (:func:`quantized_metadata`); a layer vLLM cannot hold block-wise (a merged projection whose shards are not
multiples of the block: SmolLM2-135M's k/v of 192 rows) is refused, naming the ways that serve it
(:func:`block_fp8_problems`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from lightning_vllm.weights.model import ModelMetadata

FP8 = torch.float8_e4m3fn
"""The dtype of a block-wise FP8 weight (e4m3, vLLM's on CUDA)."""

SCALE_SUFFIX = "_scale_inv"
"""What names a weight's block scales: ``X.weight`` -> ``X.weight_scale_inv`` (float32, one per block)."""

BLOCK = (128, 128)
"""The block of every FP8 checkpoint the field ships (DeepSeek-V3, Qwen3-FP8) and of vLLM's online ``fp8_per_block``."""

# The shards vLLM merges into one tensor (qkv_proj, gate_up_proj) ahead of the last: their rows must fill whole blocks
# (fp8_utils.validate_fp8_block_shape: the last may end in a partial block; under tensor parallelism none may).
_LEADING_SHARDS = ("q_proj", "k_proj", "gate_proj")


def block_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D) quantized block-wise to e4m3: the values and the float32 scale of each block (its largest
    magnitude over e4m3's largest, at least ``1e-4 / 448``), as vLLM's ``per_block_cast_to_fp8`` computes them, on
    ``weight``'s device. Blocks at the edges are partial; their scales are those of the values they hold.

    Example::

        >>> values, scales = block_fp8(torch.full((130, 4), 2.0, dtype=torch.bfloat16))
        >>> values.dtype, tuple(values.shape), tuple(scales.shape), values.float().max().item() * scales.max().item()
        (torch.float8_e4m3fn, (130, 4), (2, 1), 2.0)
    """
    rows, columns = weight.shape
    block_rows, block_columns = block
    padded = weight.new_zeros(
        math.ceil(rows / block_rows) * block_rows, math.ceil(columns / block_columns) * block_columns
    )
    padded[:rows, :columns] = weight
    blocks = padded.view(-1, block_rows, padded.size(1) // block_columns, block_columns)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scales = amax / torch.finfo(FP8).max
    values = (blocks * (1.0 / scales)).to(FP8)  # (vLLM's order of operations: the same roundings, bit for bit)
    return values.view_as(padded)[:rows, :columns].contiguous(), scales.view(blocks.size(0), blocks.size(2))


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> torch.Size:
    """The shape of the block scales of a weight of ``shape``."""
    return torch.Size(math.ceil(size / step) for size, step in zip(shape, block))


def block_fp8_plan(checkpoint: Mapping[str, tuple[torch.dtype, torch.Size]]) -> frozenset[str]:
    """The weights an engine holds block-wise in FP8, read from what its checkpoint holds: each ``X.weight`` in e4m3
    beside an ``X.weight_scale_inv`` (empty for a checkpoint in the serving dtype)."""
    return frozenset(
        name
        for name, (dtype, _) in checkpoint.items()
        if dtype == FP8 and name + SCALE_SUFFIX in checkpoint and checkpoint[name + SCALE_SUFFIX][0] == torch.float32
    )


def quantized_metadata(
    metadata: Mapping[str, tuple[torch.dtype, torch.Size]], plan: frozenset[str], block: tuple[int, int] = BLOCK
) -> ModelMetadata:
    """``metadata`` (the trainer's, in its dtypes) as an engine of ``plan`` loads it: each planned weight in e4m3,
    followed by its block scales."""
    wire: ModelMetadata = {}
    for name, (dtype, shape) in metadata.items():
        if name in plan and dtype.is_floating_point and len(shape) == 2:
            wire[name] = (FP8, torch.Size(shape))
            wire[name + SCALE_SUFFIX] = (torch.float32, scale_shape(shape, block))
        else:
            wire[name] = (dtype, torch.Size(shape))
    return wire


def block_fp8_problems(
    metadata: Mapping[str, tuple[torch.dtype, torch.Size]], plan: frozenset[str], block: tuple[int, int] = BLOCK
) -> list[str]:
    """Why the weights of ``metadata`` cannot be held block-wise as ``plan`` says, one line per weight: vLLM merges
    q/k/v and gate/up, and each shard but the last must fill whole blocks of rows (``fp8_utils`` refuses others).

    Example::

        >>> meta = {"model.layers.0.self_attn.k_proj.weight": (torch.bfloat16, torch.Size([192, 576]))}
        >>> block_fp8_problems(meta, frozenset(meta))  # doctest: +ELLIPSIS
        ["model.layers.0.self_attn.k_proj.weight has 192 rows, not a multiple of the 128-row block: ..."]
    """
    return [
        f"{name} has {shape[0]} rows, not a multiple of the {block[0]}-row block: vLLM merges it with the projections "
        "after it and cannot hold it block-wise. Serve this model from its bf16 checkpoint with "
        "quantization='fp8_per_tensor' or 'fp8_per_channel' (vLLM quantizes at load; no blocks)"
        for name, (_, shape) in metadata.items()
        if name in plan and name.rsplit(".", 2)[-2] in _LEADING_SHARDS and shape[0] % block[0]
    ]
