"""LoRA policies: an adapter push against a merged push, into the same LoRA-enabled engine.

For each size, one vLLM engine (CPU, bfloat16, gloo, ``enable_lora=True``,
``max_lora_rank=8``) and one PEFT policy (rank 8 on the attention and MLP
projections: q, k, v, o, gate, up, down). Both methods push the same policy through
one updater, ``runs`` times each after two untimed warm-ups (the adapter's first
warm-up is the push that sends the base weights once). They run one block after the
other, not alternating: a merged push replaces the base weights, so the adapter push
after it would send them again.

- ``merged``: ``VLLMUpdater(lora="merged")``, base + adapter merged into full weights (before
  each push the adapter counts as written, as after a training step; changed-only pushes then
  leave out the layer groups no adapter touches: the embeddings);
- ``adapter``: ``VLLMUpdater(lora="adapter")``, the adapter's tensors alone.

Each run is timed twice: the push alone, and the push followed by the first request
that uses the new weights (one prompt, one token), since vLLM loads an adapter at
the first request after an update.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cpu_engine import start_engine, stop_engine
from models import ModelSize, build_model, save

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = ("merged", "adapter")


@dataclass
class LoraResult:
    """One size's figures: bytes per push and seconds per run, by method."""

    name: str
    num_bytes: dict[str, int] = field(default_factory=dict)
    push_seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METHODS})
    served_seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METHODS})

    def median(self, method: str, served: bool = False) -> float:
        return statistics.median((self.served_seconds if served else self.push_seconds)[method])


def lora_policy(size: ModelSize) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(build_model(size), config)


def measure_lora(size: ModelSize, workdir: Path, num_runs: int, bucket_size_bytes: int) -> LoraResult:
    """Both methods on ``size``, in an engine of ``cpu_engine.start_engine`` with LoRA enabled."""
    from vllm import SamplingParams

    from lightning_vllm import VLLMUpdater

    policy = lora_policy(size)
    model_dir = save(build_model(size), workdir / f"{size.name}-lora" / "model")
    print(f"\n== LoRA r={RANK} on {size.name}: adapter against merged pushes", flush=True)
    llm = start_engine(model_dir, enable_lora=True, max_lora_rank=RANK, max_loras=1)
    result = LoraResult(size.name)
    try:
        updater = VLLMUpdater(engine=llm, bucket_size_bytes=bucket_size_bytes)
        one_token = SamplingParams(max_tokens=1, temperature=0.0)

        def run(method: str) -> tuple[float, float]:
            # A training step wrote the adapter (only the version counters move, outside the timing).
            torch.autograd.graph.increment_version([p for p in policy.parameters() if p.requires_grad])
            start = time.perf_counter()
            stats = updater.push_weights(policy)
            pushed = time.perf_counter()
            updater.engine.generate([[1, 2, 3, 4]], one_token)  # type: ignore[union-attr]  # through the adapter
            result.num_bytes[method] = stats.num_bytes
            return pushed - start, time.perf_counter() - start

        for method in METHODS:
            updater.set_options(lora=method)
            run(method)  # warm-up; the adapter's first push also sends the base weights
            run(method)
            for _ in range(num_runs):
                push, served = run(method)
                result.push_seconds[method].append(push)
                result.served_seconds[method].append(served)
            runs = ", ".join(f"{seconds:.3f}" for seconds in result.push_seconds[method])
            print(f"   {method}: {result.num_bytes[method] / 1e6:.2f} MB, push seconds {runs}", flush=True)
        updater.close()
    finally:
        stop_engine(llm)
    return result


def lora_table(results: list[LoraResult]) -> str:
    rows = [
        "| model | method | MB per push | push s (median) | push + first request s "
        "| merged / adapter: bytes | seconds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for method in METHODS:
            ratio_bytes = result.num_bytes["merged"] / result.num_bytes[method]
            ratio_seconds = result.median("merged") / result.median(method)
            rows.append(
                f"| {result.name} | {method} | {result.num_bytes[method] / 1e6:.2f} | {result.median(method):.3f} | "
                f"{result.median(method, served=True):.3f} | {ratio_bytes:.1f} | {ratio_seconds:.1f} |"
            )
    return "\n".join(rows)


def lora_line(largest: LoraResult) -> str:
    """One line of the largest size's ratios (merged over adapter: higher is better)."""
    bytes_ratio = largest.num_bytes["merged"] / largest.num_bytes["adapter"]
    return (
        f"lora {largest.name}: merged_over_adapter_bytes={bytes_ratio:.1f} "
        f"merged_over_adapter_seconds={largest.median('merged') / largest.median('adapter'):.1f} "
        f"with_first_request={largest.median('merged', True) / largest.median('adapter', True):.1f}"
    )
