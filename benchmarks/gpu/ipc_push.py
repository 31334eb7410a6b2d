"""An 8B-shaped bf16 push over ipc into vLLM's own engine, against a device-to-device copy of the same
tensors, in the same run on one GPU (docs/gpu.md, "ipc at the speed of one copy").

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/ipc_push.py [--out DIR]

It builds Llama-3-8B's shape in bf16 on the GPU (random weights) and a real ``vllm.LLM`` of the
same shape from dummy weights (the GPU tier's engine settings: Triton attention, eager, vLLM's
kernels as torch-native stand-ins), then times, as medians of ``--rounds``:

* ``copy``: ``copy_`` of every tensor into a buffer of its own, allocated once (the floor: one copy);
* ``push``: ``VLLMUpdater.push_weights`` over ipc with the trainer's own tensors handed to the engine
  (vLLM's unpacked mode, what lightning-vllm does when the trainer holds the engine's dtypes);
* ``packed push``: the same with vLLM's packed producer (a copy into its buffer, then the load).

After the pushes the engine's parameters are read back (float64 sums on its GPU) and must equal the
trainer's. Each call the push makes to the engine is timed too (``calls``: the medians of
``start_weight_update``, ``update_weights``, ``finish_weight_update``, pause, resume, the prefix cache
reset), which says where a push's seconds go inside vLLM. Prints ``name=value`` lines; writes
``ipc_push.json`` into ``--out`` (default ``$OUT`` or ``.``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

LLAMA_3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip


def build_model(model_dir: Path, shape: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """Llama-3-8B's shape (or another Llama ``shape``) in bf16 on the GPU, random weights; its config saved to
    ``model_dir`` for vLLM."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(shape or LLAMA_3_8B), architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    config.save_pretrained(model_dir)  # all vLLM's dummy loader reads
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def timed(fn, rounds: int) -> list[float]:
    seconds = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def copy_floor(tensors: list[torch.Tensor], rounds: int) -> list[float]:
    """Seconds of a ``copy_`` of every tensor into a buffer of its own, allocated once (warmed first)."""
    buffers = [torch.empty_like(tensor) for tensor in tensors]

    def copy() -> None:
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)

    copy()
    seconds = timed(copy, rounds)
    buffers.clear()
    torch.cuda.empty_cache()
    return seconds


def timed_pushes(updater, model: torch.nn.Module, rounds: int, calls: dict[str, list[float]]):
    """Seconds of ``rounds`` pushes (the group joined by a first, untimed one), and the median push's stats;
    ``calls`` holds the timed pushes' control calls only."""
    updater.push_weights(model)
    for values in calls.values():
        values.clear()
    stats = []
    seconds = timed(lambda: stats.append(updater.push_weights(model)), rounds)
    return seconds, sorted(stats, key=lambda each: each.seconds)[len(stats) // 2]


CONTROL_CALLS = (
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "pause_generation",
    "resume_generation",
    "reset_prefix_cache",
)


def time_control_calls() -> dict[str, list[float]]:
    """Time every control call a push makes to an in-process engine (``LocalLLMEngine``), by name."""
    from lightning_vllm.engines.local import LocalLLMEngine

    seconds: dict[str, list[float]] = {name: [] for name in CONTROL_CALLS}
    for name in CONTROL_CALLS:
        call = getattr(LocalLLMEngine, name)

        def timed_call(self, *args, _call=call, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _call(self, *args, **kwargs)
            finally:
                seconds[_name].append(time.perf_counter() - start)

        setattr(LocalLLMEngine, name, timed_call)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--unpacked-only", action="store_true", help="leave out the packed baseline")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # vLLM's RPC carries the handles as pickle

    from gpu_helpers import digests_equal, engine_digest, gpu_llm, model_digest, stop_llm

    from lightning_vllm import VLLMUpdater
    from lightning_vllm.backends.ipc import IPCBackend

    model_dir = Path(tempfile.mkdtemp(prefix="llama8b-"))
    model = build_model(model_dir)
    tensors = [parameter.detach() for parameter in model.parameters()]
    num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    copy_seconds = copy_floor(tensors, args.rounds)

    llm = gpu_llm(
        model_dir, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.3, max_model_len=256, max_num_seqs=4
    )
    results: dict[str, object] = {"parameters": sum(t.numel() for t in tensors), "bytes": num_bytes}
    try:
        modes = (("push", True),) if args.unpacked_only else (("push", True), ("packed_push", False))
        calls = time_control_calls()
        for label, share in modes:
            IPCBackend.share_trainer_tensors = share
            updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False)
            seconds, middle = timed_pushes(updater, model, args.rounds, calls)
            landed = digests_equal(engine_digest(llm), model_digest(model))
            updater.close()
            results[label] = {
                "seconds": seconds,
                "landed_exactly": landed,
                "transfer_seconds": middle.timing.transfer_seconds,
                "commit_seconds": middle.timing.commit_seconds,
                "pause_seconds": middle.timing.pause_seconds,
                "gb_per_second": middle.gb_per_second,
                "calls": {name: statistics.median(values) for name, values in calls.items() if values},
            }
    finally:
        IPCBackend.share_trainer_tensors = True
        stop_llm(llm)
    copy_median = statistics.median(copy_seconds)
    results["copy_seconds"] = copy_seconds
    figures = {
        "copy_seconds": copy_median,
        "copy_gb_per_second": num_bytes / copy_median / 1e9,
        "push_seconds": statistics.median(results["push"]["seconds"]),  # type: ignore[index]
    }
    figures["ipc_push_over_copy"] = figures["push_seconds"] / copy_median
    if "packed_push" in results:
        figures["packed_push_seconds"] = statistics.median(results["packed_push"]["seconds"])  # type: ignore[index]
        figures["ipc_packed_push_over_copy"] = figures["packed_push_seconds"] / copy_median
    results["figures"] = figures
    for name, value in figures.items():
        print(f"{name}={value:.4g}")
    for label in ("push", "packed_push"):
        if label in results:
            print(f"{label}_landed_exactly={results[label]['landed_exactly']}")  # type: ignore[index]
            for name, value in results[label]["calls"].items():  # type: ignore[index]
                print(f"{label}_{name}_seconds={value:.4g}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ipc_push.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
