"""DeepSpeed ZeRO-3 on CPU (DS_ACCELERATOR=cpu, gloo, outside Lightning) on 2 processes: every rank
takes part in a push, rank 0 sends to a real vLLM engine. Started by test_sharded.py.

Lightning's DeepSpeedStrategy refuses a CPU accelerator, so this drives DeepSpeed directly.
Usage: zero3_run.py RANK PORT MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RANK, PORT = int(sys.argv[1]), sys.argv[2]
os.environ.update(
    DS_ACCELERATOR="cpu",
    RANK=str(RANK),
    LOCAL_RANK=str(RANK),
    WORLD_SIZE="2",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=PORT,
)
sys.path.insert(0, str(Path(__file__).parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from helpers import (  # noqa: E402
    TinyCausalLM,
    build_llm,
    push_from_every_rank_and_record,
    shutdown,
    tiny_qwen2,
)

from lightning_vllm import VLLMUpdater  # noqa: E402
from lightning_vllm.ranks import TrainerRanks  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}


def main(model_dir: Path, out_dir: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    llm = build_llm(model_dir) if RANK == 0 else None
    ranks = TrainerRanks(timeout_seconds=30)
    updater = VLLMUpdater(engine=llm, timeout_seconds=30)
    result: dict = {"rank": RANK}
    # A Hugging Face model, then a LightningModule holding one, as DeepSpeedStrategy wraps it.
    for seed, in_lightning_module in ((5, False), (6, True)):
        reference = tiny_qwen2(seed=seed)
        model = TinyCausalLM(tiny_qwen2(seed=seed)) if in_lightning_module else tiny_qwen2(seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
        key = "LightningModule" if in_lightning_module else "model"
        push_from_every_rank_and_record(result, key, updater, ranks, engine, reference, llm)
    (out_dir / f"zero3_rank{RANK}.json").write_text(json.dumps(result))
    updater.close()
    ranks.close()
    if llm is not None:
        shutdown(llm)


if __name__ == "__main__":
    main(Path(sys.argv[3]), Path(sys.argv[4]))
