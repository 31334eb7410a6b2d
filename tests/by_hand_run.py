"""FSDP1 and DeepSpeed ZeRO-3 on CPU, driven by hand (gloo, outside Lightning) on 2 processes:
every rank takes part in each push, rank 0 sends to one real vLLM engine. Started by
test_ranks.py; one script and one engine for both (an engine costs ~20 s to start).

Lightning's FSDPStrategy and DeepSpeedStrategy refuse a CPU accelerator, so this drives
torch's ``FullyShardedDataParallel`` and DeepSpeed (``DS_ACCELERATOR=cpu``) directly.
Usage: by_hand_run.py RANK PORT MODEL_DIR OUT_DIR
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

ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
}


def fsdp1_cases(result: dict, updater: VLLMUpdater, ranks: TrainerRanks, llm) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    for seed, use_orig_params, in_lightning_module in ((5, True, False), (6, False, False), (7, True, True)):
        reference = tiny_qwen2(seed=seed)
        # As Lightning's FSDPStrategy does: the LightningModule itself is the FSDP root.
        model = FSDP(
            TinyCausalLM(tiny_qwen2(seed=seed)) if in_lightning_module else tiny_qwen2(seed=seed),
            auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
        )
        case = "LightningModule" if in_lightning_module else f"use_orig_params={use_orig_params}"
        push_from_every_rank_and_record(result, f"FSDP1 {case}", updater, ranks, model, reference, llm)


def zero3_cases(result: dict, updater: VLLMUpdater, ranks: TrainerRanks, llm) -> None:
    # A Hugging Face model, then a LightningModule holding one, as DeepSpeedStrategy wraps it.
    for seed, in_lightning_module in ((8, False), (9, True)):
        reference = tiny_qwen2(seed=seed)
        model = TinyCausalLM(tiny_qwen2(seed=seed)) if in_lightning_module else tiny_qwen2(seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3_CONFIG)
        case = "LightningModule" if in_lightning_module else "model"
        push_from_every_rank_and_record(result, f"ZeRO-3 {case}", updater, ranks, engine, reference, llm)


def main(model_dir: Path, out_dir: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")  # the default group FSDP1 uses too
    llm = build_llm(model_dir) if RANK == 0 else None
    ranks = TrainerRanks(timeout_seconds=30)
    updater = VLLMUpdater(engine=llm, timeout_seconds=30)
    result: dict = {"rank": RANK}
    fsdp1_cases(result, updater, ranks, llm)
    zero3_cases(result, updater, ranks, llm)
    (out_dir / f"by_hand_rank{RANK}.json").write_text(json.dumps(result))
    updater.close()
    ranks.close()
    if llm is not None:
        shutdown(llm)


if __name__ == "__main__":
    main(Path(sys.argv[3]), Path(sys.argv[4]))
