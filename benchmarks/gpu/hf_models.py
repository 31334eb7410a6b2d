"""Hugging Face models of known shapes, loading by name, and per-tensor digests for bit-exact checks.

Shared by the trainer process and the receiver process; imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config

Digest = tuple[str, tuple[int, ...], int, int]
"""``(dtype, shape, sum, weighted sum)`` of a tensor's bits read as 16-bit integers."""

DIGEST_CHUNK = 1 << 26  # elements per GPU step: bounds the int64 temporaries (0.5 GiB each)
_WEIGHT_MODULUS = 65521  # the largest prime below 2**16: weights stay below 2**16, sums never overflow int64


def qwen2_1p5b() -> Qwen2Config:
    """Qwen2.5-1.5B's shape (1.54 B parameters, tied embeddings)."""
    return Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip


LLAMA_3_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    tie_word_embeddings=False,
)  # fmt: skip
"""Llama-3-8B's shape (8.03 B parameters, 16.1 GB in bfloat16, untied embeddings): the receiver runs' large model,
and the model ``vllm_engine.build_model`` pushes into vLLM's own engine."""


def llama3_8b() -> LlamaConfig:
    """Llama-3-8B's shape (:data:`LLAMA_3_8B`)."""
    return LlamaConfig(**LLAMA_3_8B)


def qwen2_tiny() -> Qwen2Config:
    """A tiny tied Qwen2 for checks on CPU."""
    return Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip


def llama_tiny() -> LlamaConfig:
    """A tiny untied Llama for checks on CPU."""
    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip


MODELS = {"qwen2-1.5b": qwen2_1p5b, "llama3-8b": llama3_8b, "qwen2-tiny": qwen2_tiny, "llama-tiny": llama_tiny}


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: PretrainedConfig, device: str | torch.device, seed: int, dtype: torch.dtype = torch.bfloat16
) -> PreTrainedModel:
    """A randomly initialised causal LM of ``config``'s shape, made directly on ``device`` in ``dtype``.

    Built under a default dtype rather than cast afterwards, so an 8B model never exists in float32.
    """
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def load_weights(model: PreTrainedModel, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters by checkpoint name; returns the bytes loaded.

    A model that ties its embeddings skips ``lm_head.weight``, as vLLM's models do: its head is
    the input embedding. Unknown names, other shapes or other dtypes raise (vLLM's loader would
    convert dtypes silently; a harness that checks bits must not).
    """
    params = dict(model.named_parameters())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    loaded = 0
    with torch.no_grad():
        for name, tensor in weights:
            if tied and name == "lm_head.weight":
                continue
            param = params.get(name)
            if param is None:
                raise KeyError(f"{name!r} is not a weight of this {type(model).__name__}")
            if param.shape != tensor.shape or param.dtype != tensor.dtype:
                raise ValueError(
                    f"{name!r}: got {tensor.dtype} {tuple(tensor.shape)}, the model has {param.dtype} "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)
            loaded += tensor.numel() * tensor.element_size()
    return loaded


def loaded_metadata(model: PreTrainedModel) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """``{name: (dtype, shape)}`` of what :func:`load_weights` takes (a tied head is listed once, as the embedding)."""
    return {name: (param.dtype, param.shape) for name, param in model.named_parameters()}


def digest(tensor: torch.Tensor) -> Digest:
    """A digest of ``tensor``'s bits, computed where the tensor lives.

    The bits are read as 16-bit integers (8-bit for 1-byte dtypes); the digest holds their sum and
    a position-weighted sum (weights in [1, 65521]), exact in int64 and so identical on any device and
    in any reduction order. Any change of one element changes both sums; a swap of two elements goes
    unseen only if their positions differ by a multiple of 65521.
    """
    flat = tensor.detach().contiguous().view(-1)
    ints = flat.view(torch.int8 if flat.element_size() == 1 else torch.int16)
    total = weighted = 0
    for start in range(0, ints.numel(), DIGEST_CHUNK):
        values = ints[start : start + DIGEST_CHUNK].to(torch.int64)
        positions = torch.arange(start, start + values.numel(), device=values.device, dtype=torch.int64)
        weights = (positions % _WEIGHT_MODULUS) * 40503 % _WEIGHT_MODULUS + 1
        total += int(values.sum())
        weighted += int((values * weights).sum())
    return str(tensor.dtype), tuple(tensor.shape), total, weighted


def model_digests(model: torch.nn.Module) -> dict[str, Digest]:
    """:func:`digest` of every parameter by name; a sharded (DTensor) one is gathered first.

    With DTensors this is a collective: every rank must call it at the same point.
    """
    from torch.distributed.tensor import DTensor

    result = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        result[name] = digest(full)
        del full
    return result


def tensor_to_bytes(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A CPU copy of ``tensor`` as plain bytes: a multiprocessing pipe then carries it by value (torch would
    otherwise share its storage through shared memory, or a CUDA tensor through CUDA IPC)."""
    data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data


def tensor_from_bytes(packed: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    """The tensor :func:`tensor_to_bytes` made."""
    dtype_name, shape, data = packed
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype_name)).reshape(shape)


def mismatches(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Names whose entries differ or are missing on either side, sorted."""
    return sorted(name for name in expected.keys() | actual.keys() if expected.get(name) != actual.get(name))
