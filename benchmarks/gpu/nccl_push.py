"""An 8B-shaped bf16 push over nccl into vLLM's own engine on a second GPU, against a bare NCCL broadcast of the
same bytes between the same two processes (docs/gpu.md; the target: the push reaches 0.9 of the broadcast).

Needs two GPUs: NCCL puts each rank of a group on a GPU of its own. On the GPU host, with ``.gpu-carry``
beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/nccl_push.py [--rounds 7] [--out DIR]

It builds Llama-3-8B's shape in bf16 on GPU 0 (random weights, ``ipc_push.build_model``) and a real
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

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests"), str(HERE.parents[1] / "tests" / "gpu")]

from nccl_floor import timed_broadcasts  # noqa: E402


def receive_broadcasts(worker: Any, address: str, port: int, num_bytes: int, rounds: int) -> None:
    """In vLLM's worker (cloudpickled): receive ``rounds`` broadcasts of ``num_bytes`` from rank 0."""
    import torch
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    device = torch.cuda.current_device()
    comm = stateless_init_process_group(address, port, 1, 2, device)
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    for _ in range(rounds):
        comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    comm.destroy()
    del buffer
    torch.cuda.empty_cache()


def raw_broadcast(llm: Any, num_bytes: int, rounds: int) -> list[float]:
    """Seconds of ``rounds`` bare broadcasts of ``num_bytes`` from GPU 0 to vLLM's worker (after one untimed)."""

    def receive(address: str, port: int, num_bytes: int, rounds: int) -> Any:
        return llm.collective_rpc(receive_broadcasts, args=(address, port, num_bytes, rounds))

    return timed_broadcasts(receive, num_bytes, rounds, torch.device("cuda", 0))


def timed_pushes(updater: Any, model: torch.nn.Module, rounds: int) -> list[float]:
    """Seconds of ``rounds`` pushes of ``model`` (the group joined by a first, untimed one)."""
    updater.push_weights(model)
    seconds = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        updater.push_weights(model)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(
            "nccl_push needs two GPUs (the trainer on one, vLLM on another): NCCL puts each rank of a group on a "
            f"GPU of its own; this host has {gpus}."
        )
        sys.exit(2)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the raw floor's receiver is a function

    from gpu_helpers import digests_equal, engine_digest, engines_start_on_second_gpu, gpu_llm, model_digest, stop_llm
    from ipc_push import build_model

    from lightning_vllm import VLLMUpdater

    torch.cuda.set_device(0)
    model_dir = Path(tempfile.mkdtemp(prefix="llama8b-"))
    model = build_model(model_dir)  # on cuda:0
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with engines_start_on_second_gpu():
        llm = gpu_llm(
            model_dir, backend="nccl", dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.3,
            max_model_len=256, max_num_seqs=4,
        )  # fmt: skip
    try:
        updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False)
        push_seconds = timed_pushes(updater, model, args.rounds)
        stats = updater.push_weights(model)
        landed = digests_equal(engine_digest(llm), model_digest(model))
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
    for name, value in figures.items():
        print(f"{name}={value:.4g}")
    print(f"nccl_push_landed_exactly={landed}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"figures": figures, "push_seconds": push_seconds, "raw_seconds": raw_seconds, "landed_exactly": landed}
    (args.out / "nccl_push.json").write_text(json.dumps(results, indent=1) + "\n")
    if not landed:
        sys.exit(1)


if __name__ == "__main__":
    main()
