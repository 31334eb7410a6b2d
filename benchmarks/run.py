"""The sync benchmark suite (``make bench``): ours against disk, per-tensor and the floor.

For each model size a real vLLM engine (CPU, bfloat16, gloo backend) is started once,
then every method runs in turn, in a rotating order, ``--runs`` times after one
untimed warm-up each. Results go to ``docs/benchmarks.md`` (between its result
markers) and ``docs/images/benchmarks.png``. The last line printed is::

    ratios: floor_over_ours=F disk_over_ours=D per_tensor_over_ours=P peak_mem_over_bucket=M
            sharded_peak_over_group_plus_bucket=S ours_over_overlap_floor=O async_stall_over_blocking=A

(one line), S being the worst rank of a push from a policy sharded with FSDP2 over 2
trainer processes (``sharded_memory.py``), O ours over the larger of the transfer alone
and vLLM's load alone at the largest size, A the training loop's stall per push point
with ``blocking=False`` over a blocking push (``stall.py``).

Run ``python benchmarks/run.py --help`` for the options; ``--quick`` runs the
smallest size once without warm-ups, the sharded push beside the rest, writing into a
temporary folder (the test suite's smoke test, which checks that every figure is
measured, not how fast).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

import torch  # noqa: E402
from callback_cost import CallbackCost, measure_callback_cost  # noqa: E402
from cpu_engine import start_engine, stop_engine  # noqa: E402
from lora import LoraResult, lora_line, lora_table, measure_lora  # noqa: E402
from methods import METHODS, SyncMethods, peak_extra_rss_bytes  # noqa: E402
from models import MANY_TENSORS, SIZES, ModelSize, build_model, num_parameters, save  # noqa: E402
from report import (  # noqa: E402
    ModelResult,
    changed_only_table,
    command_line,
    linear_fit,
    measured_on,
    plot,
    ratios_line,
    replace_results,
    sharded_table,
    targets_table,
    timing_table,
)
from sharded_memory import bound_ratio  # noqa: E402
from sharded_memory import measure as measure_sharded  # noqa: E402
from stall import StallResult, measure_stall, stall_text  # noqa: E402

from lightning_vllm import VLLMUpdater  # noqa: E402
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES  # noqa: E402

REPOSITORY = BENCHMARKS.parent


def measure_model(
    size: ModelSize,
    workdir: Path,
    *,
    num_runs: int,
    bucket_size_bytes: int,
    cost_steps: int,
    stall_steps: int = 0,
    warm_up: bool = True,
) -> tuple[ModelResult, CallbackCost | None, StallResult | None]:
    model = build_model(size)
    model_dir = save(model, workdir / size.name / "model")
    result = ModelResult(
        name=size.name,
        num_parameters=num_parameters(model),
        num_tensors=len(list(model.parameters())),
        num_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        bucket_size_bytes=bucket_size_bytes,
        seconds={method: [] for method in METHODS},
    )
    print(
        f"\n== {size.name}: {result.num_parameters / 1e6:.1f}M parameters, {result.num_tensors} tensors, "
        f"{result.num_bytes / 1e6:.1f} MB",
        flush=True,
    )
    llm = start_engine(model_dir)
    cost = stall = None
    try:
        result.peak_extra_bytes, result.peak_extra_bytes_converting = memory_figures(llm, model, bucket_size_bytes)
        methods = SyncMethods(llm, model, workdir / size.name, bucket_size_bytes)
        for method in METHODS if warm_up else ():  # the first calls load code and page memory in
            methods.run(method)
        for run in range(num_runs):
            order = METHODS[run % len(METHODS) :] + METHODS[: run % len(METHODS)]
            for method in order:
                seconds = methods.run(method)
                result.seconds[method].append(seconds)
            print(
                f"   run {run + 1}/{num_runs}: " + ", ".join(f"{m} {result.seconds[m][-1]:.3f}s" for m in METHODS),
                flush=True,
            )
        parts = methods.floor_client.parts[-num_runs:]
        result.transport_seconds = [part["transport_seconds"] for part in parts]
        result.load_seconds = [part["load_seconds"] for part in parts]
        result.bytes_sent = dict(methods.bytes_sent)
        result.checked_layers = list(methods.checked_layers)
        print(
            f"   floor parts (median): transport {sorted(result.transport_seconds)[len(parts) // 2]:.3f}s, "
            f"load {sorted(result.load_seconds)[len(parts) // 2]:.3f}s; ours over the overlap floor "
            f"{result.ours_over_overlap_floor:.2f}",
            flush=True,
        )
        methods.close()
        rounds = max(1, min(num_runs, 3))
        if cost_steps:
            cost = measure_callback_cost(
                llm, model, vocab_size=size.vocab_size, num_steps=cost_steps, num_rounds=rounds, warm_up=warm_up
            )
        if stall_steps:
            stall = measure_stall(
                llm,
                model,
                vocab_size=size.vocab_size,
                num_steps=stall_steps,
                num_rounds=rounds,
                warm_up=warm_up and not cost,
            )
            print("   " + stall_text(stall, size.name), flush=True)
    finally:
        stop_engine(llm)
    return result, cost, stall


def first_push_memory(llm: object, model: torch.nn.Module, bucket_size_bytes: int) -> int:
    """Peak extra resident memory of the trainer during the first push of a new updater.

    The first push allocates the staging buffer, so it is the worst case.
    """
    updater = VLLMUpdater(engine=llm, bucket_size_bytes=bucket_size_bytes, timeout_seconds=600)
    updater.init(VLLMUpdater.get_model_metadata(model))
    gc.collect()
    peak = peak_extra_rss_bytes(lambda: updater.push_weights(model))
    updater.close()
    return peak


def memory_figures(llm: object, model: torch.nn.Module, bucket_size_bytes: int) -> tuple[int, int]:
    """Peak extra memory of a first push of the bfloat16 model, and of a float32 copy of it.

    bfloat16 weights of 4 MiB or more travel from their own memory, so little is
    staged; float32 master weights into the bfloat16 engine are all converted through
    the staging buffer, which is the case that fills it.
    """
    bfloat16 = first_push_memory(llm, model, bucket_size_bytes)
    float32_model = copy.deepcopy(model).float()
    float32 = first_push_memory(llm, float32_model, bucket_size_bytes)
    del float32_model
    gc.collect()
    return bfloat16, float32


def check_cost_text(results: list[ModelResult]) -> str:
    """What the check after every push costs, per size: the medians of checked over ours, and the layers each
    checked push compared, of the layers the engine should hold (the fewest over its pushes)."""
    return ", ".join(
        f"{result.name} {result.median('checked') / result.median('ours'):.3f} ({coverage_text(result)})"
        for result in results
    )


def coverage_text(result: ModelResult) -> str:
    """``"every layer: 171 of 171"``, or the fewest layers a checked push compared, of how many."""
    if not result.checked_layers:
        return "no checked push"
    compared, layers = min(result.checked_layers)
    every = all(compared == layers for compared, layers in result.checked_layers)
    return f"{'every layer: ' if every else 'layers compared: '}{compared} of {layers}"


def results_markdown(
    results: list[ModelResult],
    many: ModelResult,
    cost: CallbackCost | None,
    stall: tuple[str, StallResult] | None,
    sharded: list[dict],
    lora: list[LoraResult],
    args: argparse.Namespace,
    image: str,
) -> str:
    fit_lines = ["| (needs two sizes or more) | | | |"] if len(results) < 2 else []
    for method in METHODS if len(results) >= 2 else ():
        fit = linear_fit(results, method)
        fit_lines.append(
            f"| {method} | {fit.intercept_seconds:.3f} | {fit.bytes_per_second / 1e9:.2f} | {fit.r_squared:.4f} |"
        )
    cost_text = "Not measured in this run."
    if cost is not None:
        cost_text = (
            f"{cost.num_steps} training steps of the {results[0].name} model (float32 policy, a 4-token rollout "
            f"per step), medians over rounds: {cost.step_never * 1e3:.0f} ms per step without the callback, "
            f"{cost.step_every * 1e3:.0f} ms with a push every step: {cost.extra * 1e3:.0f} ms extra per step, of "
            f"which {cost.push * 1e3:.0f} ms inside `push_weights` (including the push at fit start) and "
            f"{cost.overhead * 1e3:+.0f} ms elsewhere."
        )
    return f"""
{measured_on()}, bucket {args.bucket_mib} MiB,
{args.runs} timed runs per method after one warm-up.
Command: `{command_line("benchmarks/run.py")}`.

![sync time versus size]({image})

{timing_table([*results, many], METHODS)}

The check after every push (`verify_pushes`, on by default; `ours` leaves it off, `checked` is ours with it):
checked / ours {check_cost_text([*results, many])}.
Every layer is checked: the linear layers this CPU build packs for oneDNN are fingerprinted on the engine's
side as vLLM packs them, where the loader has just written them (`weights/packed_sums.py`).

Atomic updates (the workers receive the whole update, then load it in one call) against
`streaming` (each segment loaded as it lands, the design before): ours / streaming
{", ".join(f"{result.name} {result.ratio('ours', 'streaming'):.2f}" for result in [*results, many])}.

### Against the targets

{targets_table(results, many)}

### Linear fit: seconds = intercept + bytes / rate

| method | intercept s | rate GB/s | R² |
|---|---:|---:|---:|
{chr(10).join(fit_lines)}

### Changed-only pushes: a fine-tune with frozen embeddings

The `frozen_embed` rows above: before each push every parameter but the input embedding
is written (as a training step with `embed_tokens` frozen does), so the push leaves the
embedding's layer group out and the engine keeps it (the models tie their output embedding to it).

{changed_only_table(results)}

### The callback's cost

{cost_text}

### The trainer's stall per push: blocking against `blocking=False` (`benchmarks/stall.py`)

{stall_text(stall[1], stall[0]) if stall else "Not measured in this run."}

### A sharded policy: memory per rank

The {args.sharded_size} model sharded with FSDP2 over 2 trainer processes (gloo), a push with
every rank gathering layer group after layer group and rank 0 sending, bucket
{args.sharded_bucket_mib} MiB: each rank's peak extra resident memory during a push
(`benchmarks/sharded_memory.py`).

{sharded_table(sharded)}

### LoRA policies: the adapter alone against merged weights

A PEFT policy with rank-8 adapters on the attention and MLP projections, pushed
into one LoRA-enabled engine (`enable_lora=True`, `max_lora_rank=8`) through one
updater, merged (`lora="merged"`) then as its adapter (`lora="adapter"`), one block after
the other (a merged push replaces the base weights an adapter push counts on;
`benchmarks/lora.py`). "push + first request" adds the first one-token request after
the push, in which vLLM loads the adapter (or runs on the new merged weights). Targets:
at least 20x fewer bytes and 5x less time than the merged push at the largest size.

{lora_table(lora) + chr(10) * 2 + "`" + lora_line(lora[-1]) + "`" if lora else "Not measured in this run."}

```
{ratios_line(results[-1], many, max(bound_ratio(rank) for rank in sharded), stall_ratio(stall))}
```
"""


def stall_ratio(stall: tuple[str, StallResult] | None) -> float:
    return stall[1].background_over_blocking if stall else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--runs", type=int, default=7, help="timed runs per method and size (default 7)")
    parser.add_argument("--bucket-mib", type=int, default=DEFAULT_BUCKET_SIZE_BYTES // 2**20)
    parser.add_argument(
        "--callback-steps", type=int, default=10, help="training steps per fit of the callback cost (0: skip)"
    )
    parser.add_argument("--stall-size", default="100M", choices=list(SIZES), help="model of the stall measurement")
    parser.add_argument("--stall-steps", type=int, default=6, help="training steps per fit of the stall (0: skip)")
    parser.add_argument("--sharded-size", default="100M", choices=list(SIZES), help="model of the sharded push")
    parser.add_argument("--sharded-bucket-mib", type=int, default=32, help="bucket of the sharded push")
    parser.add_argument(
        "--lora-sizes", nargs="*", default=["100M", "400M"], choices=list(SIZES), help="sizes of the LoRA runs"
    )
    parser.add_argument("--page", type=Path, help="the page to fill (default: docs/benchmarks.md)")
    parser.add_argument("--json", type=Path, help="also write every figure measured, as JSON, to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smallest size, one run and no warm-up (figures, not speed: the smoke test), no LoRA run, "
        "the page in a temporary folder unless --page",
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.runs, args.callback_steps, args.stall_steps = [next(iter(SIZES))], 1, 2, 2
        args.sharded_size = args.stall_size = next(iter(SIZES))
        args.lora_sizes = []  # a LoRA engine costs half a minute more; its helpers have unit tests
        args.page = args.page or Path(tempfile.mkdtemp(prefix="lightning_vllm_bench_")) / "benchmarks.md"
    args.page = args.page or REPOSITORY / "docs" / "benchmarks.md"
    bucket_size_bytes = args.bucket_mib * 2**20

    def measure_sharded_push() -> list[dict]:
        print(f"\n== sharded push: {args.sharded_size} over 2 ranks", flush=True)
        return measure_sharded(args.sharded_size, args.sharded_bucket_mib * 2**20)

    results: list[ModelResult] = []
    cost = stall = None
    # --quick wants figures, not speed: the sharded push (two processes and an engine of their own) runs
    # beside the rest, its processes starting while this one mostly waits for its own engines to start.
    beside = ThreadPoolExecutor(max_workers=1)
    sharded_quick = beside.submit(measure_sharded_push) if args.quick else None
    with tempfile.TemporaryDirectory(prefix="lightning_vllm_bench_") as tmp:
        for index, name in enumerate(args.sizes):
            result, size_cost, size_stall = measure_model(
                SIZES[name],
                Path(tmp),
                num_runs=args.runs,
                bucket_size_bytes=bucket_size_bytes,
                cost_steps=args.callback_steps if index == 0 else 0,
                stall_steps=args.stall_steps if name == args.stall_size else 0,
                warm_up=not args.quick,
            )
            results.append(result)
            cost = cost or size_cost
            stall = stall or ((name, size_stall) if size_stall else None)
        many, _, _ = measure_model(
            MANY_TENSORS,
            Path(tmp),
            num_runs=args.runs,
            bucket_size_bytes=bucket_size_bytes,
            cost_steps=0,
            warm_up=not args.quick,
        )
        lora = [measure_lora(SIZES[name], Path(tmp), args.runs, bucket_size_bytes) for name in args.lora_sizes]

    sharded = sharded_quick.result() if sharded_quick else measure_sharded_push()
    beside.shutdown()
    image = args.page.parent / "images" / "benchmarks.png"
    plot(results, METHODS, image)
    markdown = results_markdown(
        results, many, cost, stall, sharded, lora, args, image.relative_to(args.page.parent).as_posix()
    )
    replace_results(args.page, markdown)
    if args.json:
        figures = {"models": results, "many_tensors": many, "callback_cost": cost, "stall": stall, "sharded": sharded}
        args.json.write_text(json.dumps(figures, default=as_plain, indent=1))
    print(markdown)
    print(f"Wrote {args.page} and {image}")
    if lora:
        print(lora_line(lora[-1]))
    print(ratios_line(results[-1], many, max(bound_ratio(rank) for rank in sharded), stall_ratio(stall)))


def as_plain(value: object) -> object:
    """A figure as JSON can hold it: dataclasses as dicts, anything else as its text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


if __name__ == "__main__":
    main()
