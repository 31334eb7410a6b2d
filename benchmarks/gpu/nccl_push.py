"""An 8B-shaped bf16 push over nccl into vLLM's own engine on a second GPU, against a bare NCCL broadcast of the
same bytes between the same two processes (docs/runs.md; the target: the push reaches 0.9 of the broadcast).

Needs two GPUs: NCCL puts each rank of a group on a GPU of its own. On the GPU host, with ``.gpu-carry``
beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/nccl_push.py [--rounds 7] [--out DIR]

It builds Llama-3-8B's shape in bf16 on GPU 0 (random weights, ``vllm_engine.build_model``) and a real
``vllm.LLM`` of the same shape from dummy weights whose engine core sees GPU 1 only, built with
``weight_transfer_config={"backend": "nccl"}``. Then, as medians of ``--rounds`` (after one untimed round):

* ``push``: ``VLLMUpdater.push_weights`` of every tensor (``changed_only=False``), checked by float64 digests
  of every engine parameter after the last;
* ``raw``: the same number of bytes broadcast by vLLM's bare ``PyNcclCommunicator`` (no packing, no loading)
  from this process to vLLM's worker, which receives them in a ``collective_rpc`` (a function: the engine is
  built with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

Prints ``name=value`` lines, ``nccl_push_share_of_raw`` (the raw broadcast's seconds over the push's) among
them, and writes ``nccl_push.json`` into ``--out`` (default ``$OUT`` or ``.``). Exits 1 when the push did not
land exactly, 2 with fewer than two GPUs.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from figures import options, print_figures, timed, write_results  # noqa: E402
from nccl_floor import timed_broadcasts  # noqa: E402  # (vLLM spawns its engine core with this sys.path)
from vllm_engine import allow_pickled_rpc, build_model, dummy_llm, landed_exactly  # noqa: E402


def receive_broadcasts(worker: Any, address: str, port: int, num_bytes: int, rounds: int) -> list[float]:
    """In vLLM's worker (cloudpickled): ``nccl_floor.receive_broadcasts`` on the worker's GPU."""
    import nccl_floor
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    return nccl_floor.receive_broadcasts(address, port, num_bytes, rounds, device)


def raw_broadcast(llm: Any, num_bytes: int, rounds: int) -> list[float]:
    """Seconds of ``rounds`` bare broadcasts of ``num_bytes`` from GPU 0 to vLLM's worker (after one untimed)."""

    def receive(address: str, port: int, num_bytes: int, rounds: int) -> Any:
        return llm.collective_rpc(receive_broadcasts, args=(address, port, num_bytes, rounds))

    return timed_broadcasts(receive, num_bytes, rounds, torch.device("cuda", 0))


def main() -> None:
    args = options(__doc__, rounds=7).parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(
            "nccl_push needs two GPUs (the trainer on one, vLLM on another): NCCL puts each rank of a group on a "
            f"GPU of its own; this host has {gpus}."
        )
        sys.exit(2)
    allow_pickled_rpc()  # the raw floor's receiver is a function

    from gpu_helpers import stop_llm

    from lightning_vllm import VLLMUpdater, engine_on_gpus

    torch.cuda.set_device(0)
    model_dir = Path(tempfile.mkdtemp(prefix="llama8b-"))
    model = build_model(model_dir)  # on cuda:0
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with engine_on_gpus(1):
        llm = dummy_llm(model_dir, backend="nccl")
    try:
        updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False)
        updater.push_weights(model)  # joins the group; untimed
        push_seconds = timed(lambda: updater.push_weights(model), args.rounds)
        stats = updater.push_weights(model)
        landed = landed_exactly(llm, model)
        updater.close()
        raw_seconds = raw_broadcast(llm, num_bytes, args.rounds)
    finally:
        stop_llm(llm)
    push, raw = statistics.median(push_seconds), statistics.median(raw_seconds)
    figures = {
        "bytes": float(num_bytes),
        "nccl_push_seconds": push,
        "nccl_push_gb_per_second": num_bytes / push / 1e9,
        "raw_broadcast_seconds": raw,
        "raw_broadcast_gb_per_second": num_bytes / raw / 1e9,
        "nccl_push_share_of_raw": raw / push,
        "transfer_seconds": stats.timing.transfer_seconds,
        "commit_seconds": stats.timing.commit_seconds,
    }
    print_figures(figures)
    print(f"nccl_push_landed_exactly={landed}")
    results = {"figures": figures, "push_seconds": push_seconds, "raw_seconds": raw_seconds, "landed_exactly": landed}
    write_results(args.out, "nccl_push.json", results)
    if not landed:
        sys.exit(1)


if __name__ == "__main__":
    main()
