"""Turns timings into the figures the benchmark page shows: table, fit, ratios, plot, and where they were measured."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RESULTS_START = "<!-- results:start -->"
RESULTS_END = "<!-- results:end -->"


@dataclass
class ModelResult:
    """Every timing of one model: ``seconds[method]`` holds one entry per run."""

    name: str
    num_parameters: int
    num_tensors: int
    num_bytes: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    peak_extra_bytes: int | None = None
    peak_extra_bytes_converting: int | None = None
    bucket_size_bytes: int = 0
    # The floor's two parts, per run: the transfer while the worker only receives, then vLLM's
    # in-memory load of what arrived.
    transport_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)  # per method of ours, bytes of one push
    checked_layers: list[tuple[int, int]] = field(default_factory=list)  # per checked push: compared, of sent

    def median(self, method: str) -> float:
        return statistics.median(self.seconds[method])

    def ratio(self, slower: str, faster: str = "ours") -> float:
        """How many times faster ``faster`` is than ``slower`` (medians)."""
        return self.median(slower) / self.median(faster)

    @property
    def overlap_floor(self) -> float:
        """What a push that overlapped moving and loading perfectly would take: the slower of the two alone."""
        if not self.transport_seconds or not self.load_seconds:
            return float("nan")
        return max(statistics.median(self.transport_seconds), statistics.median(self.load_seconds))

    @property
    def ours_over_overlap_floor(self) -> float:
        return self.median("ours") / self.overlap_floor

    @property
    def peak_mem_over_bucket(self) -> float | None:
        """The larger of the two memory figures (as sent, and converting from float32), over one bucket."""
        measured = [b for b in (self.peak_extra_bytes, self.peak_extra_bytes_converting) if b is not None]
        if not measured:
            return None
        return max(measured) / self.bucket_size_bytes


@dataclass(frozen=True)
class LinearFit:
    """``seconds = intercept + bytes / bytes_per_second``, least squares over the model sizes."""

    intercept_seconds: float
    bytes_per_second: float
    r_squared: float


def linear_fit(results: Sequence[ModelResult], method: str) -> LinearFit:
    x = np.array([result.num_bytes for result in results], dtype=float)
    y = np.array([result.median(method) for result in results])
    slope, intercept = np.polyfit(x, y, 1)
    predicted = intercept + slope * x
    total = float(((y - y.mean()) ** 2).sum())
    r_squared = 1.0 - float(((y - predicted) ** 2).sum()) / total if total else 1.0
    return LinearFit(float(intercept), float(1.0 / slope) if slope > 0 else float("inf"), r_squared)


def ratios_line(
    largest: ModelResult,
    many_tensors: ModelResult,
    sharded_over_bound: float = float("nan"),
    async_stall_over_blocking: float = float("nan"),
) -> str:
    """The suite's last line, read by scripts (figures at the largest size; per-tensor on the many-tensor model;
    the sharded push's worst rank; the training loop's stall per push point, background over blocking)."""
    memory = largest.peak_mem_over_bucket
    compared, layers = min(largest.checked_layers, default=(0, 0))
    return (
        f"ratios: floor_over_ours={largest.median('floor') / largest.median('ours'):.3f} "
        f"disk_over_ours={largest.ratio('disk'):.3f} "
        f"per_tensor_over_ours={many_tensors.ratio('per_tensor'):.3f} "
        f"peak_mem_over_bucket={memory if memory is not None else float('nan'):.3f} "
        f"sharded_peak_over_group_plus_bucket={sharded_over_bound:.3f} "
        f"ours_over_overlap_floor={largest.ours_over_overlap_floor:.3f} "
        f"async_stall_over_blocking={async_stall_over_blocking:.3f} "
        f"checked_over_ours={largest.median('checked') / largest.median('ours'):.3f} "
        f"checked_layers={compared}/{layers}"
    )


def changed_only_table(results: Sequence[ModelResult]) -> str:
    """Per size: a push of a fine-tune with frozen embeddings against a full push (bytes and seconds)."""
    lines = [
        "| model | full push MB | frozen embeddings MB | full s | frozen embeddings s | bytes saved | time saved |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        full, frozen = result.bytes_sent.get("ours"), result.bytes_sent.get("frozen_embed")
        if full is None or frozen is None:
            continue
        lines.append(
            f"| {result.name} | {_mb(full)} | {_mb(frozen)} | {result.median('ours'):.3f} "
            f"| {result.median('frozen_embed'):.3f} | {1 - frozen / full:.0%} "
            f"| {1 - result.median('frozen_embed') / result.median('ours'):.0%} |"
        )
    return "\n".join(lines)


def sharded_table(ranks: Sequence[dict]) -> str:
    """Per rank: the model, its shard, the bound (largest layer group + bucket) and the measured peak."""
    lines = [
        "| rank | model MB | shard MB | largest group MB | bucket MB | peak extra MB | peak / (group + bucket) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank in ranks:
        bound = rank["largest_group_bytes"] + rank["bucket_size_bytes"]
        lines.append(
            f"| {rank['rank']} | {_mb(rank['full_bytes'])} | {_mb(rank['shard_bytes'])} "
            f"| {_mb(rank['largest_group_bytes'])} | {_mb(rank['bucket_size_bytes'])} "
            f"| {_mb(rank['peak_extra_bytes'])} | {rank['peak_extra_bytes'] / bound:.2f} |"
        )
    return "\n".join(lines)


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.0f}" if num_bytes >= 1e7 else f"{num_bytes / 1e6:.1f}"


def timing_table(results: Sequence[ModelResult], methods: Sequence[str]) -> str:
    lines = [
        "| model | params | tensors | MB | method | median s | min s | max s | GB/s | vs ours |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for method in methods:
            if method not in result.seconds:
                continue
            runs = result.seconds[method]
            median = statistics.median(runs)
            lines.append(
                f"| {result.name} | {result.num_parameters / 1e6:.0f}M | {result.num_tensors} "
                f"| {_mb(result.num_bytes)} "
                f"| {method} | {median:.3f} | {min(runs):.3f} | {max(runs):.3f} "
                f"| {result.num_bytes / median / 1e9:.2f} | {median / result.median('ours'):.2f}x |"
            )
    return "\n".join(lines)


def targets_table(results: Sequence[ModelResult], many_tensors: ModelResult) -> str:
    lines = [
        "| model | transport alone s | load alone s | ours / overlap floor (target <= 1.3 at the largest) "
        "| ours / floor (target <= 1.15) | disk / ours (target >= 1.5 at the largest) "
        "| peak extra memory MB, bfloat16 policy | float32 policy | larger / bucket (target <= 1.25) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        memory = result.peak_mem_over_bucket
        transport = statistics.median(result.transport_seconds) if result.transport_seconds else float("nan")
        load = statistics.median(result.load_seconds) if result.load_seconds else float("nan")
        lines.append(
            f"| {result.name} | {transport:.3f} | {load:.3f} | {result.ours_over_overlap_floor:.2f} "
            f"| {result.median('ours') / result.median('floor'):.2f} | {result.ratio('disk'):.2f} "
            f"| {_mb(result.peak_extra_bytes or 0)} | {_mb(result.peak_extra_bytes_converting or 0)} "
            f"| {memory if memory is not None else float('nan'):.2f} |"
        )
    lines.append("")
    lines.append(
        f"Many-tensor model ({many_tensors.num_tensors} tensors, {_mb(many_tensors.num_bytes)} MB): "
        f"per-tensor / ours = {many_tensors.ratio('per_tensor'):.1f} (target >= 5)."
    )
    return "\n".join(lines)


def plot(results: Sequence[ModelResult], methods: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    sizes = [result.num_bytes / 1e6 for result in results]
    for method in methods:
        medians = [result.median(method) for result in results]
        lows = [medians[i] - min(result.seconds[method]) for i, result in enumerate(results)]
        highs = [max(result.seconds[method]) - medians[i] for i, result in enumerate(results)]
        axis.errorbar(sizes, medians, yerr=[lows, highs], marker="o", capsize=3, label=method)
    axis.set_xlabel("bytes sent per sync (MB, bfloat16)")
    axis.set_ylabel("seconds per sync (median, min-max bars)")
    axis.set_title("Weight sync into a vLLM engine on a 2-core CPU")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def measured_on() -> str:
    """The first words of a section of the page: the day, this machine's CPU cores, torch's and vLLM's versions."""
    import torch
    import vllm

    return (
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores ({platform.machine()}),\n"
        f"torch {torch.__version__}, vLLM {vllm.__version__}"
    )


def command_line(script: str) -> str:
    """The command that made a section of the page: ``script`` with this run's arguments."""
    return " ".join(["python", script, *sys.argv[1:]])


def replace_results(page: Path, results_markdown: str, start: str = RESULTS_START, end: str = RESULTS_END) -> None:
    """Put ``results_markdown`` between the page's markers ``start`` and ``end`` (by default those of
    ``make bench``'s results), leaving the prose around them alone."""
    text = page.read_text() if page.exists() else f"# Benchmarks\n\n{start}\n{end}\n"
    if start not in text or end not in text:
        raise ValueError(f"{page} has no {start} ... {end} section to fill.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{start}\n{results_markdown.strip()}\n{end}{tail}")
