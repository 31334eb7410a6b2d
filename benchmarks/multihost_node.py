"""One trainer node of the multi-host benchmark (``multihost.py`` starts it in the node's namespace).

``python multihost_node.py SERVER_URL SYNC_PORT OUT_DIR --size 100M --rounds 5``, launched the way
torch is launched on a cluster: ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` (the global rank:
one process per node) and ``GLOO_SOCKET_IFNAME``. Both ranks build the same random model and shard
it with FSDP2 over a 1-D mesh of the 2 ranks, then push it into the server the two ways, one after
the other in a rotating order: ``rank0`` (every rank gathers, rank 0 sends everything) and
``every_rank`` (each rank sends its own shard). Two phases: ``limited`` (``multihost.py`` has shaped
each node's egress), then, once ``multihost.py`` has removed the limit, ``full_speed``. Each phase
pushes each mode once untimed first. Last, every rank moves its shard a little and pushes with
``every_rank``, then the same weights with ``rank0``: the server's prompt logprobs after each are
compared with the gathered model's, and with each other.

Rank 0 writes ``OUT_DIR/result.json``; it creates ``OUT_DIR/limited.done`` after the first phase
and waits (bounded) for ``multihost.py`` to create ``OUT_DIR/unlimited``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS.parent / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import PROMPTS, engine_prompt_logprobs, hf_prompt_logprobs, max_abs_diff, wait_for_health  # noqa: E402
from models import SIZES, build_model, fully_shard_layers  # noqa: E402

from lightning_vllm import HTTPEngine, VLLMUpdater  # noqa: E402
from lightning_vllm.fronts.lightning.ranks import TrainerRanks  # noqa: E402
from lightning_vllm.fronts.lightning.roles import EveryRankShares, LockstepGathers  # noqa: E402

NUM_RANKS = 2
MODES = ("rank0", "every_rank")
TIMEOUT_SECONDS = 120.0  # the updater's: a limited push of the 100M model takes seconds, not minutes
PHASE_WAIT_SECONDS = 120.0  # for multihost.py to lift the limit
NOISE_SCALE = 1e-3  # what the check adds to every weight (the model's own are of scale 0.02)
INTERFACE_TX = Path("/sys/class/net/lv0/statistics/tx_bytes")  # this host's one interface (tests/hosts.py)


def sent_bytes() -> int:
    """Bytes this host has sent on its link to the others so far (``ip netns exec`` mounts its own sysfs)."""
    return int(INTERFACE_TX.read_text())


def sharded_model(size_name: str) -> torch.nn.Module:
    """The benchmark's model in float32, each decoder layer and the whole model sharded with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model(SIZES[size_name]).float()  # the same seed on every rank, and in multihost.py
    fully_shard_layers(model, init_device_mesh("cpu", (NUM_RANKS,)))
    return model


def gathered_model(model: torch.nn.Module, size_name: str) -> torch.nn.Module:
    """The sharded weights gathered into a plain model (a collective: every rank calls it)."""
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    plain = build_model(SIZES[size_name]).float()
    missing, unexpected = plain.load_state_dict(full, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # tied to the embedding
    return plain.eval()


class Pushes:
    """Times pushes in both modes, as every rank sees them; figures kept on rank 0."""

    def __init__(self, updater: VLLMUpdater, model: torch.nn.Module, ranks: TrainerRanks) -> None:
        self.updater, self.model, self.ranks = updater, model, ranks
        self.plans = {"rank0": LockstepGathers(ranks), "every_rank": EveryRankShares(ranks)}

    def push(self, mode: str) -> dict:
        """One push in ``mode`` on every rank; its wall seconds on rank 0, and each host's bytes sent."""
        dist.barrier()  # both ranks start together, so rank 0's clock covers the whole push
        before = sent_bytes()
        start = time.perf_counter()
        stats = self.plans[mode].push(self.updater.weight_sync, self.model)
        seconds = time.perf_counter() - start
        sent = [0] * NUM_RANKS
        dist.all_gather_object(sent, sent_bytes() - before)
        return {
            "seconds": seconds,
            "stats_seconds": stats.seconds if stats else None,
            "num_bytes": stats.num_bytes if stats else None,
            "host_sent_bytes": sent,
        }

    def phase(self, num_rounds: int) -> dict[str, list[dict]]:
        """One untimed push of each mode, then ``num_rounds`` rounds of both in a rotating order."""
        for mode in MODES:
            self.push(mode)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for index in range(num_rounds):
            order = MODES[index % 2 :] + MODES[: index % 2]
            for mode in order:
                runs[mode].append(self.push(mode))
            if self.ranks.rank == 0:
                line = ", ".join(f"{mode} {runs[mode][-1]['seconds']:.2f}s" for mode in MODES)
                print(f"   round {index + 1}/{num_rounds}: {line}", flush=True)
        return runs


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.2)


def check_every_rank_push(pushes: Pushes, engine: HTTPEngine, size_name: str, rank: int) -> dict:
    """Move every rank's shard a little and push with ``every_rank``; then push the same weights with
    ``rank0``. On rank 0: how far the served prompt logprobs are from the gathered model's before and
    after, how far they moved, and how far the two modes' served logprobs are from each other."""
    built = gathered_model(pushes.model, size_name)  # a collective
    served = {}
    if rank == 0:  # what the server holds now: the model as built, pushed many times
        served["before"] = engine_prompt_logprobs(engine)
    noise = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for param in pushes.model.parameters():
            local = param.to_local()
            local.add_(torch.randn(local.shape, generator=noise) * NOISE_SCALE)
    for mode in ("every_rank", "rank0"):
        pushes.push(mode)
        if rank == 0:
            served[mode] = engine_prompt_logprobs(engine)
    moved = gathered_model(pushes.model, size_name)
    if rank != 0:
        return {}
    return {
        "gap_before": max_abs_diff(served["before"], hf_prompt_logprobs(built)),
        "served_moved_by": max_abs_diff(served["before"], served["every_rank"]),
        "logprob_gap": max_abs_diff(served["every_rank"], hf_prompt_logprobs(moved)),
        "rank0_gap": max_abs_diff(served["rank0"], hf_prompt_logprobs(moved)),
        "every_rank_vs_rank0": max_abs_diff(served["every_rank"], served["rank0"]),
        "noise_scale": NOISE_SCALE,
        "prompts": len(PROMPTS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("sync_port", type=int)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", default="100M", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rank = int(os.environ["NODE_RANK"])
    torch.set_num_threads(1)  # two "hosts" and the server share this machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=NUM_RANKS,
        timeout=datetime.timedelta(seconds=600),
    )
    model = sharded_model(args.size)
    ranks = TrainerRanks(timeout_seconds=TIMEOUT_SECONDS)
    engine = HTTPEngine(args.url)
    updater = VLLMUpdater(
        engine=engine,
        master_address=os.environ["MASTER_ADDR"],
        master_port=args.sync_port,
        timeout_seconds=TIMEOUT_SECONDS,
    )
    wait_for_health(args.url, 300)
    pushes = Pushes(updater, model, ranks)
    result: dict = {"size": args.size, "rounds": args.rounds}
    try:
        result["limited"] = pushes.phase(args.rounds)
        if rank == 0:
            (args.out_dir / "limited.done").touch()
            wait_for_file(args.out_dir / "unlimited", PHASE_WAIT_SECONDS)
        dist.barrier()
        result["full_speed"] = pushes.phase(args.rounds)
        result["check"] = check_every_rank_push(pushes, engine, args.size, rank)
    finally:
        updater.close()
        ranks.close()
    if rank == 0:
        result["num_parameters"] = sum(param.numel() for param in model.parameters())
        result["model_bytes"] = sum(param.numel() * param.element_size() for param in model.parameters())
        medians = {
            phase: {mode: statistics.median(run["seconds"] for run in result[phase][mode]) for mode in MODES}
            for phase in ("limited", "full_speed")
        }
        print(f"   medians: {json.dumps(medians)}; check: {json.dumps(result['check'])}", flush=True)
        (args.out_dir / "result.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
