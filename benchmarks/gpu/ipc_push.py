"""An 8B-shaped bf16 push over ipc into vLLM's own engine, against a device-to-device copy of the same
tensors, in the same run on one GPU (docs/gpu.md, "ipc at the speed of one copy").

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
from vllm_engine import allow_pickled_rpc, build_model, dummy_llm, landed_exactly


def copy_floor(tensors: list[torch.Tensor], rounds: int, batched: bool = False, summed: bool = False) -> list[float]:
    """Seconds of a ``copy_`` of every tensor into a buffer of its own, allocated once (warmed first); ``batched``:
    one ``torch._foreach_copy_`` of them all instead (what a replay would be with no tensor copied alone); ``summed``:
    the copies that sum what they write, as a ``lightning_ipc`` replay makes them (``weights/gpu_sums.SummedCopies``,
    one owner per tensor)."""
    buffers = [torch.empty_like(tensor) for tensor in tensors]
    if summed:
        from lightning_vllm.weights.gpu_sums import SummedCopies

        summing = SummedCopies([(b, t, i) for i, (b, t) in enumerate(zip(buffers, tensors))], len(tensors))

    def copy() -> None:
        if summed:
            summing.run()
            return
        if batched:
            torch._foreach_copy_(buffers, tensors)
            return
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

    def push() -> None:
        PUSH_STARTS.append(time.perf_counter())
        stats.append(updater.push_weights(model))

    seconds = timed(push, rounds)
    return seconds, sorted(stats, key=lambda each: each.seconds)[len(stats) // 2]


PUSH_STARTS: list[float] = []  # when each timed push began (time.perf_counter: CLOCK_MONOTONIC, one clock per host)
CALL_STARTS: dict[str, list[float]] = {}  # when each control call began, by name
STAGES: dict[str, list[float]] = {}  # when each stage of the trainer's side of a push was reached, by name


def mark_stages() -> None:
    """Note when a push's trainer side reaches each of its stages (``STAGES``): checked (``WeightSync.prepare``
    returned), handed to the sender, on the transfer thread, the update info begun and built, the worker's copies
    known to have landed, the sender and the push returned."""
    from vllm import LLM

    from lightning_vllm import VLLMUpdater
    from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesIPCTrainerEngine
    from lightning_vllm.backends.vllm_engines import VLLMEngineSender
    from lightning_vllm.core.weight_sync import WeightSync

    def marked(owner, name, before=None, after=None):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            if before:
                STAGES.setdefault(before, []).append(time.perf_counter())
            result = original(*args, **kwargs)
            if after:
                STAGES.setdefault(after, []).append(time.perf_counter())
            return result

        setattr(owner, name, call)

    marked(WeightSync, "prepare", after="1_checked")
    marked(VLLMEngineSender, "send", before="2_sender", after="7_sender_returned")
    marked(KeptHandlesIPCTrainerEngine, "send_weights", before="3_transfer_thread", after="6_landed")
    marked(KeptHandlesIPCTrainerEngine, "_update_info", before="4_update_info", after="5_update_info_built")
    marked(VLLMUpdater, "push_weights", after="8_push_returned")
    # The commit's calls, made while the worker's copies run (lightning_ipc's worker returns once they are queued).
    marked(LLM, "update_weight_version", before="5b_version_call", after="5c_version_set")
    marked(LLM, "reset_prefix_cache", after="5d_prefix_cache_reset")


CONTROL_CALLS = (
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "update_weights_in_one_call",
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
            CALL_STARTS.setdefault(_name, []).append(start)
            try:
                return _call(self, *args, **kwargs)
            finally:
                seconds[_name].append(time.perf_counter() - start)

        setattr(LocalLLMEngine, name, timed_call)
    return seconds


def python_speed(model: torch.nn.Module, rounds: int) -> dict[str, float]:
    """Seconds of pure-Python work of a push on this host's CPU, to compare hosts: one survey of the model
    (``weights/survey.py``: one walk over its modules and parameters), medians of ``rounds`` x 10."""
    import timeit

    from lightning_vllm.weights.survey import survey

    return {"survey_seconds": statistics.median(timeit.repeat(lambda: survey(model), number=10, repeat=rounds)) / 10}


def sums_figures(tensors: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """Seconds of the trainer's half of the check over ``tensors`` (``tensor_sums`` of each, one sync), the
    fused kernel against float64 chunks; medians of ``rounds`` (warmed first: the kernel compiles once)."""
    from lightning_vllm.weights import layer_sums

    figures = {}
    for label, sums in (("fused", layer_sums.tensor_sums), ("chunked", layer_sums._chunked_sums)):

        def all_sums(sums=sums) -> None:
            torch.stack([sums(tensor.reshape(-1)) for tensor in tensors]).tolist()

        started = time.perf_counter()
        all_sums()
        figures[f"sums_{label}_first_seconds"] = time.perf_counter() - started
        figures[f"sums_{label}_seconds"] = statistics.median(timed(all_sums, rounds))
    figures["sums_fused_usable"] = float(layer_sums._fused_sums.usable)
    return figures


def time_worker_updates(llm) -> None:
    """Time, inside vLLM's worker, each ``update_weights`` of its transfer engine (no RPC): what the worker's
    own load costs, read back by :func:`worker_update_seconds`."""

    def instrument(worker) -> None:  # runs in vLLM's worker (cloudpickled: defined here)
        import time

        import torch

        engine = worker.weight_transfer_engine
        original = engine.update_weights
        engine.timed_updates = []
        engine.device_spans = []  # CUDA events around each update's queued work: the copies' device time

        def timed(update_info):
            started = time.perf_counter()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                return original(update_info)
            finally:
                end.record()
                engine.timed_updates.append((started, time.perf_counter() - started))
                engine.device_spans.append((begin, end))

        engine.update_weights = timed

    llm.collective_rpc(instrument)


def worker_update_seconds(llm) -> list[tuple[float, float]]:
    """When the worker's ``update_weights`` began and its seconds, since the last call (and forgets them)."""

    def read(worker) -> list[tuple[float, float]]:  # runs in vLLM's worker
        seconds = list(getattr(worker.weight_transfer_engine, "timed_updates", []))
        worker.weight_transfer_engine.timed_updates = []
        return seconds

    return llm.collective_rpc(read)[0]


def worker_device_seconds(llm) -> list[float]:
    """The device time of the work each ``update_weights`` queued (its copies), since the last call (and forgets
    them): against the copy floor, whether the worker's copies run at the floor's speed."""

    def read(worker) -> list[float]:  # runs in vLLM's worker
        import torch

        spans = list(getattr(worker.weight_transfer_engine, "device_spans", []))
        worker.weight_transfer_engine.device_spans = []
        torch.cuda.synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in spans]

    return llm.collective_rpc(read)[0]


def push_figures(llm, model, label: str, rounds: int, calls, **options) -> dict[str, object]:
    """``rounds`` timed pushes of ``model`` into ``llm`` with ``options``, the last checked by digest."""
    from gpu_helpers import trainer_engine

    from lightning_vllm import VLLMUpdater

    updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False, **options)
    CALL_STARTS.clear()
    PUSH_STARTS.clear()
    STAGES.clear()
    seconds, middle = timed_pushes(updater, model, rounds, calls)
    worker_updates = worker_update_seconds(llm)[-rounds:]  # the timed pushes' (the first joined the group)
    worker_seconds = [spent for _, spent in worker_updates]
    device_seconds = worker_device_seconds(llm)[-rounds:]
    # Where the push's time goes before the copies can start: the trainer until it calls the engine, then the
    # call until the worker's update begins (one clock: the same host).
    name = "update_weights_in_one_call" if CALL_STARTS.get("update_weights_in_one_call") else "update_weights"
    call_starts, push_starts = CALL_STARTS.get(name, [])[-rounds:], PUSH_STARTS[-rounds:]
    timeline = {}
    if len(call_starts) == len(push_starts) == len(worker_updates) == rounds:
        timeline = {
            "trainer_until_the_call_seconds": statistics.median(c - p for c, p in zip(call_starts, push_starts)),
            "call_until_the_worker_seconds": statistics.median(w - c for (w, _), c in zip(worker_updates, call_starts)),
            "worker_update_ends_after_push_start_seconds": statistics.median(
                w + spent - p for (w, spent), p in zip(worker_updates, push_starts)
            ),
        }
        for stage, times in sorted(STAGES.items()):
            if len(times) >= rounds:
                timeline[f"stage_{stage}_after_push_start_seconds"] = statistics.median(
                    t - p for t, p in zip(times[-rounds:], push_starts)
                )
    landed = landed_exactly(llm, model)
    # lightning_ipc's trainer engine counts the handles it exported (the rest named a kept slot).
    handles_sent = getattr(trainer_engine(updater), "handles_sent", None)
    updater.close()

    def replayed(worker) -> int:  # runs in vLLM's worker: loads replayed from lightning_ipc's records so far
        loads = getattr(worker.weight_transfer_engine, "loads", None)
        return -1 if loads is None else int(loads.replayed)

    def written(worker) -> tuple[int, int]:  # runs in vLLM's worker: parameters its last load summed as it wrote
        sums = getattr(worker.weight_transfer_engine, "written_sums", lambda: None)()
        return len(sums or {}), sum(1 for _ in worker.get_model().parameters())

    # The check's question to the worker, alone.
    report_seconds = wall_seconds(lambda: llm.collective_rpc("lightning_vllm_layer_sums"), 3)

    return {
        "handles_sent": handles_sent,
        "worker_update_seconds": statistics.median(worker_seconds) if worker_seconds else None,
        "worker_device_seconds": statistics.median(device_seconds) if device_seconds else None,
        "loads_replayed": llm.collective_rpc(replayed)[0],
        "parameters_summed_as_written": llm.collective_rpc(written)[0],
        "worker_report_seconds": statistics.median(report_seconds),
        "seconds": seconds,
        "landed_exactly": landed,
        "transfer_seconds": middle.timing.transfer_seconds,
        "commit_seconds": middle.timing.commit_seconds,
        "pause_seconds": middle.timing.pause_seconds,
        "check_seconds": middle.timing.check_seconds,
        "gb_per_second": middle.gb_per_second,
        "calls": {name: statistics.median(values) for name, values in calls.items() if values},
        "timeline": timeline,
    }


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
        time_worker_updates(llm)
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
