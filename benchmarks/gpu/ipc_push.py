"""An 8B-shaped bf16 push over ipc into vLLM's own engine, against a device-to-device copy of the same
tensors, in the same run on one GPU (docs/runs.md, "ipc at the speed of one copy").

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/ipc_push.py [--backends lightning_ipc,ipc] [--out DIR]

It builds Llama-3-8B's shape in bf16 on the GPU (random weights) and a real ``vllm.LLM`` of the
same shape from dummy weights (the GPU tier's engine settings: Triton attention, eager, vLLM's
kernels as torch-native stand-ins), then times, as medians of ``--rounds``:

* ``copy``: ``copy_`` of every tensor into a buffer of its own, allocated once (the floor: one copy); and the
  same as one ``torch._foreach_copy_`` (``batched_copy_over_copy``);
* for each backend of ``--backends`` (one engine each; ``lightning_ipc``: our engines, which keep the handles
  open and load with one batched copy, ``backends/lightning_ipc/trainer.py`` and ``worker.py``; ``ipc``: vLLM's,
  which loads through its layer-wise reload):
  * ``unverified push``: ``VLLMUpdater.push_weights`` with the trainer's own tensors handed to the engine
    (vLLM's unpacked mode, what lightning-vllm does when the trainer holds the engine's dtypes), as by
    default: ``ipc_push_over_copy`` is the first backend's over the copy;
  * ``push``: the same checked after each push (``verify_pushes=True``), whose cost is the difference;
  * ``packed push`` (``--packed``): vLLM's packed producer (a copy into its buffer, then the load).

After the pushes the engine's parameters are read back (float64 sums on its GPU) and must equal the
trainer's. Each call the push makes to the engine is timed too (``calls``: the medians of
``start_weight_update``, ``update_weights``, ``finish_weight_update``, pause, resume, the prefix cache
reset), which says where a push's seconds go inside vLLM. Prints ``name=value`` lines; writes
``ipc_push.json`` into ``--out`` (default ``$OUT`` or ``.``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from figures import options, print_figures, timed, wall_seconds, write_results
from push_timeline import (
    copy_floor,
    mark_stages,
    push_figures,
    time_control_calls,
    time_workers,
)
from vllm_engine import allow_pickled_rpc, build_model, dummy_llm


def python_speed(model: torch.nn.Module, rounds: int) -> dict[str, float]:
    """Seconds of pure-Python work of a push on this host's CPU, to compare hosts: one survey of the model
    (``weights/survey.py``: one walk over its modules and parameters), medians of ``rounds`` x 10."""
    import timeit

    from lightning_vllm.weights.survey import survey

    return {"survey_seconds": statistics.median(timeit.repeat(lambda: survey(model), number=10, repeat=rounds)) / 10}


def sums_figures(tensors: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """Seconds of the trainer's half of the check over ``tensors`` (``tensor_sums`` of each, one sync), the
    fused kernel against float64 chunks, and all in one launch (``batched``, as a push sums them); medians of
    ``rounds`` (warmed first: the kernels compile once)."""
    from lightning_vllm.weights import gpu_sums, layer_sums

    figures = {}
    for label, sums in (("fused", layer_sums.tensor_sums), ("chunked", gpu_sums._chunked_sums)):

        def all_sums(sums=sums) -> None:
            torch.stack([sums(tensor.reshape(-1)) for tensor in tensors]).tolist()

        started = time.perf_counter()
        all_sums()
        figures[f"sums_{label}_first_seconds"] = time.perf_counter() - started
        figures[f"sums_{label}_seconds"] = statistics.median(timed(all_sums, rounds))
    figures["sums_fused_usable"] = float(gpu_sums._fused_sums.usable)

    def batched() -> None:  # the trainer's half as a push takes it: one launch per dtype (gpu_sums.batched_sums)
        layer_sums.sums_as_ints(layer_sums.sums_of_many(tensors, [None] * len(tensors)))

    batched()
    figures["sums_batched_seconds"] = statistics.median(timed(batched, rounds))
    return figures


def profile_pushes(llm, model: torch.nn.Module, out: Path, rounds: int = 5, verify_pushes: bool = False) -> None:
    """``rounds`` pushes under cProfile: where the trainer's Python goes (``ipc_push_profile.txt``, by own time and
    by cumulative time). ``verify_pushes``: checked pushes, and where the check's question to the worker goes, in
    the worker (``ipc_check_worker_profile.txt``), beside a question that does nothing (``bare_rpc_seconds``)."""
    import cProfile
    import io
    import pstats

    from lightning_vllm import VLLMUpdater

    updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False, verify_pushes=verify_pushes)
    updater.push_weights(model)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        updater.push_weights(model)
        torch.cuda.synchronize()
    profiler.disable()
    updater.close()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    out.mkdir(parents=True, exist_ok=True)
    name = "ipc_check_profile.txt" if verify_pushes else "ipc_push_profile.txt"
    (out / name).write_text(text.getvalue())
    if not verify_pushes:
        return

    def in_worker(worker) -> str:  # runs in vLLM's worker: the check's method, profiled there
        import cProfile
        import io
        import pstats

        from lightning_vllm.weights.held_sums import worker_layer_sums

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(rounds):
            worker_layer_sums(worker)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        return text.getvalue()

    (out / "ipc_check_worker_profile.txt").write_text(llm.collective_rpc(in_worker)[0])
    bare = wall_seconds(lambda: llm.collective_rpc("lightning_vllm_layer_sums_format"), rounds)
    print(f"bare_rpc_seconds={statistics.median(bare):.4g}")


@contextmanager
def packed_ipc() -> Iterator[None]:
    """Inside it, ``ipc`` pushes go through vLLM's packed producer even where the trainer holds what the engine
    loads: the baseline the unpacked pushes are measured against."""
    from lightning_vllm.backends.ipc.backend import IPCBackend

    init_info = IPCBackend.init_info

    def packed(self: IPCBackend, settings: Any) -> Any:
        return init_info(self, replace(settings, sends_as_held=False))

    IPCBackend.init_info = packed  # type: ignore[method-assign]
    try:
        yield
    finally:
        IPCBackend.init_info = init_info  # type: ignore[method-assign]


def main() -> None:
    parser = options(__doc__, rounds=7)
    parser.add_argument(
        "--backends", default="lightning_ipc,ipc", help="the engines' weight_transfer_config backends, one engine each"
    )
    parser.add_argument("--packed", action="store_true", help="also push with vLLM's packed producer")
    parser.add_argument("--profile", action="store_true", help="also profile the first backend's pushes (cProfile)")
    args = parser.parse_args()
    allow_pickled_rpc()  # vLLM's RPC carries the handles as pickle

    from gpu_helpers import stop_llm

    model_dir = Path(tempfile.mkdtemp(prefix="llama8b-"))
    model = build_model(model_dir)
    tensors = [parameter.detach() for parameter in model.parameters()]
    num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    copy_seconds = copy_floor(tensors, args.rounds)
    batched_copy_seconds = copy_floor(tensors, args.rounds, batched=True)
    summed_copy_seconds = copy_floor(tensors, args.rounds, summed=True)
    results: dict[str, object] = {"parameters": sum(t.numel() for t in tensors), "bytes": num_bytes}
    results["sums"] = sums_figures(tensors, args.rounds)
    calls = time_control_calls()
    mark_stages()
    results["python_speed"] = python_speed(model, args.rounds)
    for backend in args.backends.split(","):
        llm = dummy_llm(model_dir, backend=backend)
        time_workers(llm)
        try:
            # The check after every push, on, then off: its cost is the difference.
            results[f"{backend}_push"] = push_figures(llm, model, backend, args.rounds, calls, verify_pushes=True)
            results[f"{backend}_unverified_push"] = push_figures(
                llm, model, backend, args.rounds, calls, verify_pushes=False
            )
            if args.profile and backend == args.backends.split(",")[0]:
                profile_pushes(llm, model, args.out)
                profile_pushes(llm, model, args.out, verify_pushes=True)
            if args.packed:
                with packed_ipc():
                    results[f"{backend}_packed_push"] = push_figures(llm, model, backend, args.rounds, calls)
        finally:
            stop_llm(llm)
    copy_median = statistics.median(copy_seconds)
    results["copy_seconds"] = copy_seconds
    figures: dict[str, float] = {"copy_seconds": copy_median, "copy_gb_per_second": num_bytes / copy_median / 1e9}
    figures["batched_copy_over_copy"] = statistics.median(batched_copy_seconds) / copy_median
    figures["summed_copy_over_copy"] = statistics.median(summed_copy_seconds) / copy_median
    for backend in args.backends.split(","):
        verified = statistics.median(results[f"{backend}_push"]["seconds"])  # type: ignore[index]
        unverified = statistics.median(results[f"{backend}_unverified_push"]["seconds"])  # type: ignore[index]
        # (``checked`` in the names: ``ipc_push_over_copy`` is the summary line below.)
        figures[f"{backend}_checked_push_seconds"] = verified
        figures[f"{backend}_unverified_push_seconds"] = unverified
        figures[f"{backend}_checked_push_over_copy"] = verified / copy_median
        figures[f"{backend}_unverified_push_over_copy"] = unverified / copy_median
        figures[f"{backend}_check_cost_fraction"] = (verified - unverified) / unverified
        figures[f"{backend}_checked_over_unchecked"] = verified / unverified
        figures[f"{backend}_check_seconds"] = results[f"{backend}_push"]["check_seconds"]  # type: ignore[index]
        if f"{backend}_packed_push" in results:
            packed = statistics.median(results[f"{backend}_packed_push"]["seconds"])  # type: ignore[index]
            figures[f"{backend}_packed_push_over_copy"] = packed / copy_median
    first = args.backends.split(",")[0]
    # The product's default: pushes with the check (verify_pushes, issue 46).
    figures["ipc_push_over_copy"] = figures[f"{first}_checked_push_over_copy"]
    if "lightning_ipc" in args.backends.split(","):  # atomic and checked, as by default
        figures["atomic_ipc_push_over_copy"] = figures["lightning_ipc_checked_push_over_copy"]
        figures["checked_over_unchecked"] = figures["lightning_ipc_checked_over_unchecked"]
    figures.update({name: value for name, value in results["sums"].items()})  # type: ignore[union-attr]
    figures.update({name: value for name, value in results["python_speed"].items()})  # type: ignore[union-attr]
    results["figures"] = figures
    print_figures(figures)
    for label, result in results.items():
        if isinstance(result, dict) and "landed_exactly" in result:
            print(f"{label}_landed_exactly={result['landed_exactly']}")
            print(f"{label}_handles_sent={result['handles_sent']} {label}_loads_replayed={result['loads_replayed']}")
            print(f"{label}_worker_update_seconds={result['worker_update_seconds']}")
            print(f"{label}_parameters_summed_as_written={result['parameters_summed_as_written']}")
            print(f"{label}_worker_report_seconds={result['worker_report_seconds']}")
            print(f"{label}_worker_device_seconds={result['worker_device_seconds']}")
            for name, value in result["timeline"].items():
                print(f"{label}_{name}={value:.4g}")
            for name, value in result["calls"].items():
                print(f"{label}_{name}_seconds={value:.4g}")
    write_results(args.out, "ipc_push.json", results)
    if not all(r["landed_exactly"] for r in results.values() if isinstance(r, dict) and "landed_exactly" in r):
        sys.exit(1)


if __name__ == "__main__":
    main()
