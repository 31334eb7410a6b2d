"""What the check after every push costs on CPUs, alone: ``checked`` over ``ours`` (``methods.py``) at one size.

One engine (CPU, bfloat16, gloo, as ``run.py`` starts it); two untimed warm-up pushes of each; then ``--rounds``
rounds of ``--runs`` pushes of each, interleaved (the order alternating), every parameter written before each push
so that each sends everything. Each round gives the median checked push over the median unchecked one; the last
line printed is the median round, and the layers each checked push compared, of the layers the engine holds::

    checked_over_ours=R checked_layers=C/L

``make bench`` measures the same pair among its methods; this takes a few minutes where that takes twelve.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cpu_engine import start_engine, stop_engine
from methods import SyncMethods
from models import SIZES, build_model, save

from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES


def measure(size: str, rounds: int, runs: int) -> tuple[list[float], list[tuple[int, int]]]:
    """Each round's checked over ours, and every checked push's layers compared, of the layers held."""
    workdir = Path(tempfile.mkdtemp(prefix="check-cost-"))
    model = build_model(SIZES[size])
    llm = start_engine(save(model, workdir / "model"))
    methods = SyncMethods(llm, model, workdir, DEFAULT_BUCKET_SIZE_BYTES)
    ratios = []
    try:
        for method in ("ours", "checked", "ours", "checked"):
            methods.run(method)
        for round_number in range(rounds):
            seconds: dict[str, list[float]] = {"ours": [], "checked": []}
            for run in range(runs):
                for method in ("ours", "checked") if run % 2 == 0 else ("checked", "ours"):
                    seconds[method].append(methods.run(method))
            ours, checked = (statistics.median(seconds[method]) for method in ("ours", "checked"))
            ratios.append(checked / ours)
            print(f"round {round_number + 1}: ours {ours:.3f} s, checked {checked:.3f} s: {checked / ours:.3f}")
    finally:
        methods.close()
        stop_engine(llm)
    return ratios, methods.checked_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="400M", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=4, help="pushes of each per round")
    args = parser.parse_args()
    ratios, layers = measure(args.size, args.rounds, args.runs)
    compared, held = min(layers)
    print(f"checked_over_ours={statistics.median(ratios):.3f} checked_layers={compared}/{held}")


if __name__ == "__main__":
    main()
