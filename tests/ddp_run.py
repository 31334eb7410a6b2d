"""A two-process DDP run (CPU, gloo) with VLLMWeightSync; started by test_ddp.py.

Lightning's DDP launcher re-runs this script for rank 1 with LOCAL_RANK set; only
rank 0 builds a vLLM engine, as a user would.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from helpers import (  # noqa: E402
    RolloutCausalLM,
    build_llm,
    cpu_trainer,
    hf_prompt_logprobs,
    max_abs_diff,
    shutdown,
    tiny_qwen2,
    token_batches,
    vllm_prompt_logprobs,
)

from lightning_vllm import VLLMWeightSync  # noqa: E402

if __name__ == "__main__":
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    is_rank_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
    llm = build_llm(model_dir) if is_rank_zero else None
    module = RolloutCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=60)
    trainer = cpu_trainer(out_dir, [sync], max_steps=4, strategy="ddp", devices=2)
    trainer.fit(module, token_batches(num_batches=8))
    result = {"rank": trainer.global_rank, "weight_version": sync.weight_version, "rollouts": module.seen}
    if trainer.is_global_zero:
        module.hf.eval()
        result["max_logprob_diff"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(module.hf))
        result["engine_version"] = llm.get_weight_version()
        shutdown(llm)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
