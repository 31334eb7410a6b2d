"""Memory per rank of a push from a policy sharded with FSDP2 over 2 trainer processes.

Each rank holds half of every parameter; a push gathers one layer group at a time
on every rank, and rank 0 sends. The bound this checks: no rank holds more than
one gathered layer group plus one bucket beyond its shard. Each rank measures its
peak extra resident memory during a push (``/proc/self/clear_refs``), after one
untimed push (which connects and touches the staging buffer).

Run alone: ``python benchmarks/sharded_memory.py --size 100M --bucket-mib 32``; it
prints one JSON line per rank and a summary. ``run.py`` calls it.

``--size moe-550M`` pushes a Qwen3-MoE instead (transformers holds its experts fused, one
``[experts, 2 * intermediate, hidden]`` tensor a layer, which FSDP2 shards by expert; vLLM gets
them one by one): its largest layer group is a layer's routed experts. ``--push-from every_rank``
has each rank send its own shards, nothing gathered.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cpu_engine import start_engine, stop_engine  # noqa: E402
from methods import peak_extra_rss_bytes  # noqa: E402
from models import SIZES, build_model, fully_shard_layers, save  # noqa: E402

from lightning_vllm import VLLMUpdater  # noqa: E402
from lightning_vllm.fronts.lightning.ranks import TrainerRanks  # noqa: E402
from lightning_vllm.fronts.lightning.roles import EveryRankShares, LockstepGathers  # noqa: E402
from lightning_vllm.weights import weights_from  # noqa: E402

NUM_RANKS = 2
MOE_SIZES = {
    # 4 layers of 32 experts of 768: a layer's experts (113 MB in bfloat16) outweigh the 32000-word embeddings (49 MB)
    "moe-550M": dict(
        hidden_size=768, intermediate_size=768, moe_intermediate_size=768, num_experts=32, num_experts_per_tok=2,
        num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2, head_dim=64, vocab_size=32000,
    ),
}  # fmt: skip
"""Mixture-of-Experts models (Qwen3-MoE) measured with ``--size``."""


def build(size_name: str) -> torch.nn.Module:
    """The bfloat16 model of ``size_name`` (a Qwen2 of ``models.SIZES`` or a Qwen3-MoE of :data:`MOE_SIZES`)."""
    if size_name in SIZES:
        return build_model(SIZES[size_name])
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**MOE_SIZES[size_name], max_position_embeddings=512, torch_dtype="bfloat16")
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()


def largest_group_bytes(model: torch.nn.Module) -> int:
    """The bytes of the largest layer group sent (what a rank gathers at once; a MoE layer's routed experts, which
    vLLM loads as one module, are one group of their own)."""
    source = weights_from(model)
    sizes = {meta.name: meta.dtype.itemsize * torch.Size(meta.shape).numel() for meta in source.metadata}
    return max(sum(sizes[name] for name in group) for group in source.groups())


def rank_main(rank: int, size_name: str, bucket_size_bytes: int, workdir: str, port: int, push_from: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NUM_RANKS,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    model = build(size_name)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    group_bytes = largest_group_bytes(model)
    tensor_bytes = max(p.numel() * p.element_size() for p in model.parameters())
    llm = None
    if rank == 0:
        llm = start_engine(save(model, Path(workdir) / "model"))
    fully_shard_layers(model, init_device_mesh("cpu", (NUM_RANKS,)))
    gc.collect()
    ranks = TrainerRanks(timeout_seconds=600)
    updater = VLLMUpdater(engine=llm, bucket_size_bytes=bucket_size_bytes, timeout_seconds=600)
    plan = EveryRankShares(ranks) if push_from == "every_rank" else LockstepGathers(ranks)
    plan.push(updater.weight_sync, model)  # connects, and touches the staging buffer
    dist.barrier()
    gc.collect()
    peak = peak_extra_rss_bytes(lambda: plan.push(updater.weight_sync, model))
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    print(
        json.dumps(
            {
                "rank": rank,
                "model": size_name,
                "push_from": push_from,
                "full_bytes": full_bytes,
                "shard_bytes": shard_bytes,
                "largest_group_bytes": group_bytes,
                "largest_tensor_bytes": tensor_bytes,
                "bucket_size_bytes": bucket_size_bytes,
                "peak_extra_bytes": peak,
            }
        ),
        flush=True,
    )
    dist.barrier()
    updater.close()
    ranks.close()
    if llm is not None:
        stop_engine(llm)
    dist.destroy_process_group()


def measure(size_name: str, bucket_size_bytes: int, push_from: str = "rank0") -> list[dict]:
    """Run both ranks; their JSON lines, by rank."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="lightning_vllm_sharded_") as workdir:
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(rank),
                    "--size",
                    size_name,
                    "--bucket-bytes",
                    str(bucket_size_bytes),
                    "--workdir",
                    workdir,
                    "--port",
                    str(port),
                    "--push-from",
                    push_from,
                ],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for rank in range(NUM_RANKS)
        ]
        outputs = [process.communicate(timeout=1200)[0] for process in processes]
    if any(process.returncode for process in processes):
        raise RuntimeError(f"A rank failed: exit codes {[process.returncode for process in processes]}")
    results = [json.loads(line) for output in outputs for line in output.splitlines() if line.startswith("{")]
    return sorted(results, key=lambda result: result["rank"])


def bound_ratio(result: dict) -> float:
    """Peak extra memory over one layer group plus one bucket (the bound: at most 1)."""
    return result["peak_extra_bytes"] / (result["largest_group_bytes"] + result["bucket_size_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100M", choices=[*SIZES, *MOE_SIZES])
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument("--push-from", default="rank0", choices=["rank0", "every_rank"])
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bucket-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.size, args.bucket_bytes, args.workdir, args.port, args.push_from)
        return
    for result in measure(args.size, args.bucket_mib * 2**20, args.push_from):
        print(json.dumps(result))
        print(f"rank {result['rank']}: peak / (group + bucket) = {bound_ratio(result):.3f}")


if __name__ == "__main__":
    main()
