"""Timing and reporting of the benchmarks that push into vLLM's own engine (``vllm_engine.py``): their common
options, their clocks (the GPU idle before and after what is timed, or the host's alone), their ``name=value``
lines and JSON file."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

Result = TypeVar("Result")


def options(doc: str, rounds: int, rounds_help: str | None = None) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with the options every such benchmark takes: ``--rounds``
    (``rounds`` by default) and ``--out``, the folder of its JSON file (``$OUT``, or the current folder)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    return parser


def timed_once(fn: Callable[[], Result]) -> tuple[float, Result]:
    """Seconds of one call of ``fn``, the GPU idle before and after it, and what it returned."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def timed(fn: Callable[[], object], rounds: int) -> list[float]:
    """Seconds of ``rounds`` calls of ``fn``, each timed as :func:`timed_once` times it."""
    return [timed_once(fn)[0] for _ in range(rounds)]


def wall_seconds(fn: Callable[[], object], rounds: int) -> list[float]:
    """Seconds of ``rounds`` calls of ``fn`` on this host's clock alone, the GPU left as it is: for what the
    host waits on (a call into vLLM's worker, the trainer's Python)."""
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def print_figures(figures: Mapping[str, float]) -> None:
    """One ``name=value`` line per figure, four significant digits: the lines docs/runs.md quotes."""
    for name, value in figures.items():
        print(f"{name}={value:.4g}")


def write_results(out: Path, file_name: str, results: Mapping[str, Any]) -> None:
    """Write ``results`` as indented JSON to ``out / file_name``, making ``out`` if need be."""
    out.mkdir(parents=True, exist_ok=True)
    (out / file_name).write_text(json.dumps(results, indent=1) + "\n")
