"""Checking weights against what the engine's model loads, before any byte moves.

vLLM 0.32 has no route that lists the tensors a model loads (``/weight_info`` only
reports the version). The engine's checkpoint does: it holds exactly the tensors,
names and shapes the engine loaded at start. Its safetensors headers are read
without reading the data (:func:`checkpoint_weights`), from a local folder or, for an engine started from a hub id,
from the Hugging Face cache vLLM downloaded it into (offline: nothing is fetched). An engine with no checkpoint to
read (``load_format="dummy"`` from a folder or hub id holding only its config, as RL stacks start engines that the
first push fills) is checked against its config: transformers builds the model on the ``meta`` device (no memory),
and its tensors are named as the trainer names a model it sends (:func:`config_weights`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_vllm.errors import WeightsMismatchError
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.fp8 import SCALE_SUFFIX, block_fp8_plan, block_fp8_problems, quantized_metadata
from lightning_vllm.weights.model import ModelMetadata
from lightning_vllm.weights.sources import differs_from_input_embedding

log = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 10
TIED_OUTPUT_EMBEDDING = "lm_head.weight"
INPUT_EMBEDDING_SUFFIX = "embed_tokens.weight"
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class ExpectedWeights:
    """What an engine's model loads: ``{name: (wire dtype, shape)}``, and whether it ties embeddings.

    The wire dtype of a floating tensor is the engine's serving dtype, so weights are
    converted on the trainer (bucket by bucket) and the engine loads them as they come.
    """

    weights: ModelMetadata
    ties_word_embeddings: bool


def engine_weights(
    model: str,
    *,
    serving_dtype: torch.dtype,
    ties_word_embeddings: bool,
    hf_config: Any = None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> ExpectedWeights | None:
    """What an engine started from ``model`` (a folder or a hub id) loads: its checkpoint's tensors, from the folder
    or the local Hugging Face cache, else those of ``hf_config``'s model (see the module docstring); ``None`` if
    none can be read.

    Example::

        >>> engine_weights("/no/such/folder", serving_dtype=torch.float32, ties_word_embeddings=False) is None
        True
    """
    folder = Path(model) if Path(model).is_dir() else _cached_snapshot(model, revision, download_dir)
    found = (
        checkpoint_weights(folder, serving_dtype=serving_dtype, ties_word_embeddings=ties_word_embeddings)
        if folder is not None
        else None
    )
    if found is None and hf_config is not None:
        found = config_weights(hf_config, serving_dtype=serving_dtype, ties_word_embeddings=ties_word_embeddings)
    return found


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The folder of ``repo_id``'s snapshot in the local Hugging Face cache (where vLLM downloads), or ``None``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def config_weights(hf_config: Any, *, serving_dtype: torch.dtype, ties_word_embeddings: bool) -> ExpectedWeights | None:
    """The tensors of the model ``hf_config`` describes, built by transformers on the ``meta`` device, named as the
    trainer sends them (``weights_from``), floating ones in ``serving_dtype``; ``None`` if transformers cannot
    build it."""
    from transformers import AutoModelForCausalLM

    from lightning_vllm.weights.sources import source_metadata, weights_from

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        metadata = source_metadata(weights_from(model))
    except Exception as error:  # noqa: BLE001  # (an architecture transformers does not build: not checked, said)
        log.debug("transformers could not build the engine's model from its config: %s", error)
        return None
    wire = {
        name: (serving_dtype if dtype.is_floating_point else dtype, shape) for name, (dtype, shape) in metadata.items()
    }
    if block := config_block_fp8(hf_config):  # (a dummy engine of an FP8 checkpoint's config holds what it would)
        wire = quantized_metadata(wire, linear_weights(model, metadata, hf_config), block)
    return ExpectedWeights(loaded_by_engine(wire, ties_word_embeddings), ties_word_embeddings)


def config_block_fp8(hf_config: Any) -> tuple[int, int] | None:
    """The block of a block-wise FP8 ``quantization_config`` (an FP8 checkpoint's config), ``None`` for any other."""
    quantization = _quantization_config(hf_config)
    block = quantization.get("weight_block_size")
    return (int(block[0]), int(block[1])) if quantization.get("quant_method") == "fp8" and block else None


def _quantization_config(hf_config: Any) -> dict[str, Any]:
    """The config's ``quantization_config`` as a dict (transformers keeps a dict or its own config object)."""
    quantization = getattr(hf_config, "quantization_config", None) or {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def linear_weights(model: torch.nn.Module, metadata: ModelMetadata, hf_config: Any) -> frozenset[str]:
    """The weights of ``model``'s linear layers that an FP8 config quantizes, as vLLM does by layer type: every
    ``nn.Linear`` but the output embedding and the modules the config leaves out (``modules_to_not_convert``), and the
    experts' projections a MoE model holds fused (sent one by one, ``weights/checkpoint_layout.py``)."""
    quantization = _quantization_config(hf_config)
    skipped = [*(quantization.get("modules_to_not_convert") or []), *(quantization.get("ignored_layers") or [])]
    linear = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and not any(part in name for part in skipped)
    }
    experts = {name for name in metadata if ".experts." in name and name.endswith("proj.weight")}
    return frozenset(name for name in linear | experts if name in metadata)


def checkpoint_weights(
    model_dir: str | Path, *, serving_dtype: torch.dtype, ties_word_embeddings: bool
) -> ExpectedWeights | None:
    """The weights in a local safetensors checkpoint, or ``None`` if there is none to read."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    weights: ModelMetadata = {}
    for file in files:
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():
                tensor = checkpoint.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype(), torch.uint8)
                weights[name] = (dtype, torch.Size(tensor.get_shape()))
    # Floating tensors are loaded in the serving dtype, but a block-wise FP8 weight and its scales as they are
    # (weights/fp8.py).
    kept = block_fp8_plan(weights)
    kept |= {name + SCALE_SUFFIX for name in kept}
    wire = {
        name: (serving_dtype if dtype.is_floating_point and name not in kept else dtype, shape)
        for name, (dtype, shape) in weights.items()
    }
    return ExpectedWeights(loaded_by_engine(wire, ties_word_embeddings), ties_word_embeddings)


def metadata_problems(
    expected: Mapping[str, tuple[torch.dtype, Any]], actual: Mapping[str, tuple[torch.dtype, Any]]
) -> list[str]:
    """Every difference between the weights an engine loads and the weights offered, one line each."""
    problems = [
        f"unknown tensor {name!r} (the engine's model has no such weight)" for name in actual if name not in expected
    ]
    problems += [f"missing tensor {name!r}" for name in expected if name not in actual]
    for name, (wire_dtype, shape) in expected.items():
        if name not in actual:
            continue
        dtype, actual_shape = actual[name]
        if tuple(actual_shape) != tuple(shape):
            problems.append(f"tensor {name!r} has shape {tuple(actual_shape)}, the engine's has {tuple(shape)}")
        if not isinstance(dtype, torch.dtype) or (wire_dtype in _FLOATING and dtype not in _FLOATING):
            problems.append(f"tensor {name!r} has dtype {dtype}, which cannot be sent as {wire_dtype}")
    return problems


def _hint(problems: list[str], expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    unknown = [name for name in actual if name not in expected]
    if unknown and all("." in name and name.split(".", 1)[1] in expected for name in unknown):
        return "The names carry an extra prefix: pass the Hugging Face model itself or set model_attribute=..."
    if TIED_OUTPUT_EMBEDDING in expected and TIED_OUTPUT_EMBEDDING not in actual:
        if any(name.endswith(INPUT_EMBEDDING_SUFFIX) and name in expected for name in actual):
            return (
                "The model ties its input and output embeddings but the engine's does not: start the engine "
                "from a checkpoint saved from this model (tie_word_embeddings must agree)."
            )
    return (
        "Push the architecture the engine serves (same checkpoint, same config), or restart the engine on this model."
    )


def check_weights(
    expected: Mapping[str, tuple[torch.dtype, Any]], actual: Mapping[str, tuple[torch.dtype, Any]], *, what: str
) -> None:
    """Raise one error listing up to 10 problems, or nothing if ``actual`` fits ``expected``.

    Raises:
        WeightsMismatchError: names, shapes or dtypes do not fit.
    """
    problems = metadata_problems(expected, actual)
    if not problems:
        return
    listed = "\n  - ".join(problems[:MAX_LISTED_PROBLEMS])
    more = f"\n  (and {len(problems) - MAX_LISTED_PROBLEMS} more)" if len(problems) > MAX_LISTED_PROBLEMS else ""
    raise WeightsMismatchError(
        f"{what} do not fit the engine's model ({len(problems)} problem(s)); nothing was sent and vLLM keeps its "
        f"weights:\n  - {listed}{more}\n{_hint(problems, expected, actual)}"
    )


def loaded_by_engine(metadata: ModelMetadata, ties_word_embeddings: bool) -> ModelMetadata:
    """The part of ``metadata`` an engine loads.

    A model that ties its output embedding to its input embedding loads only the
    input one; a state dict still lists both, and the tied copy is not sent.
    """
    if ties_word_embeddings:
        return {name: meta for name, meta in metadata.items() if name != TIED_OUTPUT_EMBEDDING}
    return metadata


def check_tied_output_embedding(source: Weights, offered: Mapping[str, Any]) -> None:
    """Refuse an output embedding that is not a copy of the input one, for an engine that ties them.

    Raises:
        WeightsMismatchError: the two differ, so the engine could not serve these weights.
    """
    if TIED_OUTPUT_EMBEDDING not in offered:
        return
    embedding = differs_from_input_embedding(source, TIED_OUTPUT_EMBEDDING, INPUT_EMBEDDING_SUFFIX)
    if embedding is not None:
        raise WeightsMismatchError(
            f"The weights pushed do not fit the engine's model; nothing was sent and vLLM keeps its weights: "
            f"{TIED_OUTPUT_EMBEDDING!r} differs from {embedding!r}, but the engine's model ties its output "
            "embedding to its input embedding. Start the engine from a checkpoint saved from this model "
            "(tie_word_embeddings must agree)."
        )


def metadata_for_engine(
    expected: ExpectedWeights | None, metadata: Mapping[str, tuple[torch.dtype, Any]], engine: str
) -> tuple[dict[str, tuple[torch.dtype, Any]], bool]:
    """What goes on the wire to an engine whose model loads ``expected`` (its names and serving
    dtypes, checked against ``metadata``; an FP8 engine's in its quantized form, ``weights/fp8.py``), and whether
    that model ties its embeddings.

    Raises:
        WeightsMismatchError: ``metadata`` does not fit the engine's model.
    """
    if expected is None:
        log.warning(
            "Cannot read which weights %s loads (no safetensors checkpoint in its folder or the local Hugging Face "
            "cache, and transformers cannot build its model from its config); sending the metadata as given "
            "without checking it against the engine.",
            engine,
        )
        return dict(metadata), False
    offered = loaded_by_engine(dict(metadata), expected.ties_word_embeddings)
    if plan := block_fp8_plan(expected.weights):  # an engine started from a block-wise FP8 checkpoint
        if problems := block_fp8_problems(offered, plan):
            raise WeightsMismatchError(
                f"The model cannot be pushed into {engine}, which holds its linear layers block-wise in FP8; nothing "
                "was sent and vLLM keeps its weights:\n  - " + "\n  - ".join(problems[:MAX_LISTED_PROBLEMS])
            )
        offered = quantized_metadata(offered, plan)
    check_weights(expected.weights, offered, what="The model metadata")
    return {name: expected.weights[name] for name in offered}, expected.ties_word_embeddings
