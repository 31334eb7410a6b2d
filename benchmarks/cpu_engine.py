"""The vLLM engine the CPU benchmarks push into, started and stopped one way (``run.py``, ``check_cost.py``,
``lora.py``, ``sharded_memory.py``)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

# vLLM's workers import the floor extension by module name; they inherit this path.
BENCHMARKS = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def start_engine(model_dir: Path, **overrides: object) -> object:
    """A ``vllm.LLM`` of the model in ``model_dir`` on CPU: bfloat16, eager, the gloo backend, with the floor's
    worker methods (``floor_worker.py``, importable by vLLM's workers: importing this module puts this folder on
    their ``PYTHONPATH``); ``overrides`` add to or replace these settings."""
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        weight_transfer_config={"backend": "gloo"},
        worker_extension_cls="floor_worker.FloorWorkerExtension",
        **overrides,
    )


def stop_engine(llm: object) -> None:
    """End ``llm``'s engine core and collect what it held."""
    # vLLM's CPU engine core outlasts the default 5 s grace after SIGTERM and is killed anyway;
    # a benchmark engine holds nothing to save.
    llm.llm_engine.engine_core.shutdown(timeout=1.0)  # type: ignore[attr-defined]
    gc.collect()
