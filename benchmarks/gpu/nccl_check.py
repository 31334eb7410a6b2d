"""What the landing check costs on an 8B-shaped bf16 push over nccl into vLLM's own engine on one GPU: the same
pushes with the check after each (``verify_pushes=True``, the default) and without, in one run (docs/runs.md).

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/nccl_check.py [--backends lightning_nccl,nccl] [--rounds 3]

The one-GPU nccl setup of the tier (``tests/gpu/nccl/nccl_hosts.py``): this process and the engine core are NCCL
hosts of their own, and NCCL's bytes go through loopback sockets, so the push's seconds say nothing of NVLink; only
the ratio ``checked_over_unchecked`` is read from it (target 1.10). It builds Llama-3-8B's shape in bf16 on the GPU
(random weights, ``vllm_engine.build_model``) and, for each backend of ``--backends``, a real ``vllm.LLM`` of the same
shape from dummy weights, then times, as medians of ``--rounds`` after one untimed push each:

* ``checked``: ``VLLMUpdater.push_weights`` of every tensor (``changed_only=False``), checked after each push;
* ``unchecked``: the same with ``verify_pushes=False``.

The order alternates (checked, unchecked, checked, ...) so that a drift in the sockets' speed falls on both. After the
pushes the engine's parameters are read back and must equal the trainer's. Prints ``name=value`` lines and writes
``nccl_check.json`` into ``--out`` (default ``$OUT`` or ``.``); exits 1 when a push did not land exactly.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests" / "gpu" / "nccl")]

from figures import options, print_figures, timed_once, write_results  # noqa: E402
from vllm_engine import build_model, dummy_llm, landed_exactly  # noqa: E402


def check_figures(llm: Any, model: torch.nn.Module, rounds: int) -> dict[str, Any]:
    """``rounds`` checked and ``rounds`` unchecked pushes into ``llm``, alternating, after an untimed one.

    One updater, one group: a second updater would make the workers join a group of its own. Its connection's
    check is set aside for the unchecked pushes, which then run as with ``verify_pushes=False``.
    """
    from lightning_vllm import VLLMUpdater

    updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False, verify_pushes=True)
    seconds: dict[str, list[float]] = {"checked": [], "unchecked": []}
    check_seconds: list[float] = []
    try:
        updater.push_weights(model)  # joins the group; untimed
        connection = updater.weight_sync._engine_set.connections[0]
        check = connection.landing
        assert check is not None, "the engine's pushes are not checked: the figure would compare nothing"
        for _ in range(rounds):
            spent, stats = timed_once(lambda: updater.push_weights(model))
            seconds["checked"].append(spent)
            check_seconds.append(stats.timing.check_seconds)
            connection.landing = None
            try:
                seconds["unchecked"].append(timed_once(lambda: updater.push_weights(model))[0])
            finally:
                connection.landing = check
        landed = landed_exactly(llm, model)
    finally:
        updater.close()
    return {"seconds": seconds, "check_seconds": check_seconds, "landed_exactly": landed}


def main() -> None:
    parser = options(__doc__, rounds=3)
    parser.add_argument("--backends", default="lightning_nccl", help="weight_transfer_config backends, one engine each")
    args = parser.parse_args()

    from nccl_hosts import become_trainer_host, starting_as

    become_trainer_host()  # before any NCCL communicator in this process; digests need cloudpickled RPCs

    from gpu_helpers import stop_llm

    model_dir = Path(tempfile.mkdtemp(prefix="llama8b-"))
    model = build_model(model_dir)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results: dict[str, Any] = {"bytes": num_bytes}
    figures: dict[str, float] = {"bytes": float(num_bytes)}
    for backend in args.backends.split(","):
        with starting_as(f"engine-{backend}"):
            llm = dummy_llm(model_dir, backend=backend)
        try:
            results[backend] = check_figures(llm, model, args.rounds)
        finally:
            stop_llm(llm)
        checked = statistics.median(results[backend]["seconds"]["checked"])
        unchecked = statistics.median(results[backend]["seconds"]["unchecked"])
        figures[f"{backend}_checked_push_seconds"] = checked
        figures[f"{backend}_unchecked_push_seconds"] = unchecked
        figures[f"{backend}_check_seconds"] = statistics.median(results[backend]["check_seconds"])
        figures[f"{backend}_checked_over_unchecked"] = checked / unchecked
    first = args.backends.split(",")[0]
    figures["checked_over_unchecked"] = figures[f"{first}_checked_over_unchecked"]
    results["figures"] = figures
    print_figures(figures)
    for backend in args.backends.split(","):
        print(f"{backend}_landed_exactly={results[backend]['landed_exactly']}")
    write_results(args.out, "nccl_check.json", results)
    if not all(results[backend]["landed_exactly"] for backend in args.backends.split(",")):
        sys.exit(1)


if __name__ == "__main__":
    main()
