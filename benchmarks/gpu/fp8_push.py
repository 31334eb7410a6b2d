"""A bf16 trainer's push into an FP8 engine over ``lightning_ipc``, against one bf16 device copy of the same model, in
one run on one GPU (issue 67's targets: ``fp8_push_over_bf16_copy`` at most 1.0 for the 8B shape, 1.2 for the 10.6B
MoE; docs/fp8.md).

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/fp8_push.py [--moe] [--rounds 5] [--out DIR]

It builds Llama-3-8B's shape in bf16 on the GPU (``--moe``: Qwen3-30B-A3B's layer shape, 16 layers, 10.6B) and times,
as medians of ``--rounds``:

* ``copy``: ``copy_`` of every bf16 tensor into a buffer of its own (the floor);
* ``fp8_push``: ``VLLMUpdater.push_weights`` (checked, every tensor) into an engine started with the model's config
  and a block-wise FP8 ``quantization_config`` (``load_format="dummy"``, as verl and SkyRL start theirs): the trainer
  quantizes each projection block-wise and sends e4m3 values and scales (``weights/fp8.py``);
* ``online_push``: the same into an engine that quantizes online (``quantization="fp8_per_block"``): the trainer
  sends bf16, vLLM's layer-wise reload quantizes it.

Prints ``name=value`` lines and writes ``fp8_push.json`` into ``--out`` (default ``$OUT`` or ``.``). Not yet run on a
GPU (written in issue 67 while none was lent).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from figures import options, print_figures, timed, write_results
from push_timeline import copy_floor
from vllm_engine import allow_pickled_rpc, build_model


def push_seconds(llm: Any, model: torch.nn.Module, rounds: int) -> tuple[list[float], Any]:
    """Seconds of ``rounds`` checked pushes of every tensor (after a first, untimed one), and the last push's stats."""
    from lightning_vllm import VLLMUpdater

    updater = VLLMUpdater(engine=llm, timeout_seconds=600, changed_only=False)
    stats = updater.push_weights(model)

    def push() -> None:
        nonlocal stats
        stats = updater.push_weights(model)

    seconds = timed(push, rounds)
    updater.close()
    return seconds, stats


def main() -> None:
    parser = options(__doc__, rounds=5)
    parser.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B's layer shape, 16 layers (10.6B)")
    args = parser.parse_args()
    allow_pickled_rpc()  # vLLM's RPC carries the handles as pickle

    from gpu_helpers import dummy_bf16_llm, qwen3_moe_bf16, stop_llm, with_fp8_config

    model_dir = Path(tempfile.mkdtemp(prefix="fp8-bf16-"))
    model = qwen3_moe_bf16(model_dir) if args.moe else build_model(model_dir)
    tensors = [parameter.detach() for parameter in model.parameters()]
    num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    copy_median = statistics.median(copy_floor(tensors, args.rounds))
    results: dict[str, Any] = {"shape": "moe-10.6b" if args.moe else "llama-8b", "bytes": num_bytes}
    figures: dict[str, float] = {"copy_seconds": copy_median}
    for label, directory, overrides in (
        ("fp8_push", with_fp8_config(Path(tempfile.mkdtemp(prefix="fp8-config-")), model_dir), {}),
        ("online_push", model_dir, {"quantization": "fp8_per_block"}),
    ):
        llm = dummy_bf16_llm(directory, num_bytes, "lightning_ipc", **overrides)
        try:
            seconds, stats = push_seconds(llm, model, args.rounds)
        finally:
            stop_llm(llm)
        checked, expected = stats.checked_layers
        results[label] = {"seconds": seconds, "bytes_sent": stats.num_bytes, "checked_layers": [checked, expected]}
        figures[f"{label}_seconds"] = statistics.median(seconds)
        figures[f"{label}_over_bf16_copy"] = statistics.median(seconds) / copy_median
        figures[f"{label}_bytes_over_bf16"] = stats.num_bytes / num_bytes
        figures[f"{label}_checked_layers_share"] = checked / max(expected, 1)
    results["figures"] = figures
    print_figures(figures)
    write_results(args.out, "fp8_push.json", results)


if __name__ == "__main__":
    main()
