"""How long a push point holds the training thread on a GPU: a blocking push against a background one
(``blocking=False``), an 8B-shaped bf16 model over ipc into vLLM's own engine, in one run on one GPU
(docs/gpu.md, "Background pushes on GPUs").

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/background_stall.py [--out DIR] [--small]

The model and engine are ``ipc_push.py``'s: Llama-3-8B's shape in bf16 on the GPU (random weights) and a real
``vllm.LLM`` of the same shape from dummy weights (the GPU tier's engine settings). One untimed push joins the
group; then, as medians of ``--rounds`` push points of each kind, each after a stand-in for an optimizer step
(an in-place ``add_`` of every parameter on the training thread's stream), with that step finished on the GPU
before the push point so that neither stall counts it:

* ``blocking``: the wall time of ``VLLMUpdater.push_weights``, as the training thread sees it;
* ``background``: the wall time of ``BackgroundPusher.submit`` (what ``VLLMWeightSync(blocking=False)``
  calls at a push point), which snapshots the weights on the GPU. The next optimizer step is queued as soon
  as it returns (it overwrites the weights being sent), then the push is waited for and checked: the version
  moved by one and the engine holds the trainer's weights of the push point (float64 digests), not those
  after the step. ``background_stream`` is how long, from the push point, the training stream had to wait
  for the snapshot's copies (the cost a background push point leaves on the GPU). The first background
  push point allocates the snapshot's buffers and is left out.
* ``host_snapshot`` (``--host-rounds``, 0 to leave it out): the same with the snapshot forced into pinned
  host memory (the GPU's free memory reported as none), the path background pushes took before.

Prints ``name=value`` lines (``background_stall_over_blocking=...``, ``snapshot_where=device``), writes
``background_stall.json`` into ``--out`` (default ``$OUT`` or ``.``), and exits 1 if a check failed.
``--small`` builds a tiny Llama shape instead, to smoke-run the script in about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from figures import options, print_figures, write_results  # noqa: E402
from vllm_engine import allow_pickled_rpc, build_model, dummy_llm  # noqa: E402  # (it puts tests/gpu/ on the path)

SMALL = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip

STEP = 1e-3  # what the stand-in optimizer step adds to every weight (it changes most bf16 values of ~0.02)

Digest = tuple[float, float, float]


@dataclass(frozen=True)
class Digests:
    """The engine's and the trainer's weights as digests (``tests/gpu/gpu_helpers.py``), and their comparison."""

    engine: Callable[[], Digest]
    trainer: Callable[[], Digest]
    equal: Callable[[Digest, Digest], bool]


def optimizer_step(model: torch.nn.Module) -> None:
    """A stand-in for an optimizer step: an in-place write of every parameter, queued on the current stream."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(STEP)


def engine_holds(updater: Any, version: int) -> bool:
    """Whether every engine reports ``version``."""
    return set(updater.engine_versions().values()) == {str(version)}


def blocking_series(updater: Any, model: torch.nn.Module, digests: Digests, rounds: int) -> dict[str, list]:
    """``rounds`` blocking push points: the stall (the push's wall time), the push's own figure, and whether it
    landed (version and weights)."""
    series: dict[str, list] = {"stall_seconds": [], "push_seconds": [], "landed": []}
    for _ in range(rounds):
        optimizer_step(model)
        torch.cuda.synchronize()  # (the step is not the push's)
        start = time.perf_counter()
        stats = updater.push_weights(model)
        series["stall_seconds"].append(time.perf_counter() - start)
        series["push_seconds"].append(stats.seconds)
        landed = engine_holds(updater, stats.weight_version) and digests.equal(digests.engine(), digests.trainer())
        series["landed"].append(landed)
    return series


def background_series(pusher: Any, model: torch.nn.Module, digests: Digests, rounds: int) -> dict[str, list]:
    """``rounds`` background push points (after one left out of the figures, which allocates the snapshot's
    buffers): the stall, how long the training stream waited for the snapshot, the push's own figure, where
    the snapshot lived, and whether each push (the first included) landed with the weights of its push point
    while training wrote new ones."""
    series: dict[str, list] = {
        key: [] for key in ("stall_seconds", "submit_stall_seconds", "stream_seconds", "push_seconds", "landed")
    }
    series["where"] = []
    for round_index in range(rounds + 1):
        optimizer_step(model)
        at_push_point = digests.trainer()  # (it waits for the step)
        before = pusher.updater.weight_version
        torch.cuda.synchronize()
        push_point, stream_free = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        push_point.record()
        start = time.perf_counter()
        submitted = pusher.submit(model)
        stall = time.perf_counter() - start
        stream_free.record()  # where the next step's kernels start: after the snapshot's copies
        optimizer_step(model)  # the next step overwrites the weights the push is sending
        if not pusher.wait(pusher.updater.options.timeout_seconds):
            raise RuntimeError(f"the background push of round {round_index} did not end")
        stats = pusher.collect()  # (raises the push's error)
        engine, after_step = digests.engine(), digests.trainer()
        landed = (
            submitted.started
            and stats is not None
            and stats.weight_version == submitted.version == before + 1
            and engine_holds(pusher.updater, before + 1)
            and digests.equal(engine, at_push_point)
            and not digests.equal(engine, after_step)  # the check could fail: the weights moved on
        )
        series["landed"].append(bool(landed))
        if round_index == 0:
            continue
        stream_free.synchronize()
        series["stall_seconds"].append(stall)
        series["submit_stall_seconds"].append(submitted.stall_seconds)
        series["stream_seconds"].append(push_point.elapsed_time(stream_free) / 1e3)
        series["push_seconds"].append(stats.seconds if stats is not None else float("nan"))
        series["where"].append(pusher.memory.where)
    return series


@contextlib.contextmanager
def gpu_reported_full() -> Iterator[None]:
    """``torch.cuda.mem_get_info`` reports no free memory: snapshots go to pinned host memory."""
    real = torch.cuda.mem_get_info
    torch.cuda.mem_get_info = lambda device=None: (0, real(device)[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.mem_get_info = real  # type: ignore[assignment]


def run_series(updater: Any, model: torch.nn.Module, digests: Digests, args: argparse.Namespace) -> dict[str, Any]:
    """Every series on one engine, the background pushers closed (their snapshot memory freed) after each."""
    from lightning_vllm.fronts.lightning.background import BackgroundPusher

    updater.push_weights(model)  # joins the group (untimed)
    results: dict[str, Any] = {"blocking": blocking_series(updater, model, digests, args.rounds)}
    pusher = BackgroundPusher(updater, when_busy="wait")
    pusher.check_engines()  # as VLLMWeightSync(blocking=False) does at fit start
    try:
        results["background"] = background_series(pusher, model, digests, args.rounds)
        results["snapshot_bytes"] = pusher.memory.num_copied_bytes
    finally:
        pusher.close()
        torch.cuda.empty_cache()
    if args.host_rounds:
        pusher = BackgroundPusher(updater, when_busy="wait")
        try:
            with gpu_reported_full():
                results["host_snapshot"] = background_series(pusher, model, digests, args.host_rounds)
        finally:
            pusher.close()
    return results


def figures_of(results: dict[str, Any]) -> dict[str, float]:
    """The medians the run reports."""
    median = statistics.median
    blocking, background = results["blocking"], results["background"]
    figures = {
        "blocking_stall_seconds": median(blocking["stall_seconds"]),
        "blocking_push_seconds": median(blocking["push_seconds"]),
        "background_stall_seconds": median(background["stall_seconds"]),
        "background_stream_seconds": median(background["stream_seconds"]),
        "background_push_seconds": median(background["push_seconds"]),
    }
    figures["background_stall_over_blocking"] = figures["background_stall_seconds"] / figures["blocking_stall_seconds"]
    if "host_snapshot" in results:
        figures["host_snapshot_stall_seconds"] = median(results["host_snapshot"]["stall_seconds"])
        figures["host_snapshot_stall_over_blocking"] = (
            figures["host_snapshot_stall_seconds"] / figures["blocking_stall_seconds"]
        )
    return figures


def checks_of(results: dict[str, Any]) -> dict[str, bool]:
    """What must hold for the figures to mean anything."""
    checks = {
        "blocking_landed": all(results["blocking"]["landed"]),
        "background_landed": all(results["background"]["landed"]),
        "snapshot_on_device": set(results["background"]["where"]) == {"device"},
    }
    if "host_snapshot" in results:
        checks["host_snapshot_landed"] = all(results["host_snapshot"]["landed"])
        checks["host_snapshot_in_host_memory"] = set(results["host_snapshot"]["where"]) == {"host"}
    return checks


def report(results: dict[str, Any], out: Path) -> bool:
    """Print the figures and checks as ``name=value`` lines, write ``background_stall.json``; whether all held."""
    results["figures"], results["checks"] = figures_of(results), checks_of(results)
    print_figures(results["figures"])
    print(f"snapshot_where={'/'.join(sorted(set(results['background']['where'])))}")
    print(f"snapshot_bytes={results['snapshot_bytes']}")
    for name, passed in results["checks"].items():
        print(f"{name}={passed}")
    ok = all(results["checks"].values())
    print(f"all_checks_passed={ok}")
    write_results(out, "background_stall.json", results)
    return ok


def main() -> None:
    parser = options(__doc__, rounds=7, rounds_help="timed push points of each kind")
    parser.add_argument("--host-rounds", type=int, default=3, help="push points from pinned host memory (0: none)")
    parser.add_argument("--small", action="store_true", help="a tiny Llama shape: a smoke run of this script")
    args = parser.parse_args()
    allow_pickled_rpc()  # vLLM's RPC carries the handles as pickle

    from gpu_helpers import digests_equal, engine_digest, model_digest, stop_llm

    from lightning_vllm import VLLMUpdater

    model_dir = Path(tempfile.mkdtemp(prefix="llama-stall-"))
    model = build_model(model_dir, SMALL if args.small else None)
    llm = dummy_llm(model_dir, gpu_memory_utilization=0.1 if args.small else 0.3)
    start = time.perf_counter()
    try:
        updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False)
        digests = Digests(lambda: engine_digest(llm), lambda: model_digest(model), digests_equal)
        results = run_series(updater, model, digests, args)
        updater.close()
    finally:
        stop_llm(llm)
    results["parameters"] = sum(parameter.numel() for parameter in model.parameters())
    results["shape"] = "small" if args.small else "llama-3-8b"
    results["series_seconds"] = time.perf_counter() - start
    sys.exit(0 if report(results, args.out) else 1)


if __name__ == "__main__":
    main()
