"""FSDP1 (plain torch ``FullyShardedDataParallel`` on CPU, gloo, outside Lightning) on 2 processes:
every rank takes part in a push, rank 0 sends to a real vLLM engine. Started by test_sharded.py.

Lightning's FSDPStrategy refuses a CPU accelerator, so this drives FSDP from torch directly.
Usage: fsdp1_run.py RANK PORT MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import (  # noqa: E402
    TinyCausalLM,
    build_llm,
    push_from_every_rank_and_record,
    shutdown,
    tiny_qwen2,
)

from lightning_vllm import VLLMUpdater  # noqa: E402
from lightning_vllm.ranks import TrainerRanks  # noqa: E402


def main(rank: int, port: int, model_dir: Path, out_dir: Path) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    llm = build_llm(model_dir) if rank == 0 else None
    ranks = TrainerRanks(timeout_seconds=30)
    updater = VLLMUpdater(engine=llm, timeout_seconds=30)
    result: dict = {"rank": rank}
    cases = ((5, True, False), (6, False, False), (7, True, True))
    for seed, use_orig_params, in_lightning_module in cases:
        reference = tiny_qwen2(seed=seed)
        # As Lightning's FSDPStrategy does: the LightningModule itself is the FSDP root.
        model = FSDP(
            TinyCausalLM(tiny_qwen2(seed=seed)) if in_lightning_module else tiny_qwen2(seed=seed),
            auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
        )
        key = "LightningModule" if in_lightning_module else f"use_orig_params={use_orig_params}"
        push_from_every_rank_and_record(result, key, updater, ranks, model, reference, llm)
    (out_dir / f"fsdp1_rank{rank}.json").write_text(json.dumps(result))
    updater.close()
    ranks.close()
    if llm is not None:
        shutdown(llm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
