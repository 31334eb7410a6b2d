"""ipc into a ``vllm.LLM`` whose engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
without ``VLLM_ALLOW_INSECURE_SERIALIZATION``: two pushes, then the served logprobs against the model's.
Run by ``test_gpu_refusals.py``; prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))


def main(model_dir: str) -> None:
    from gpu_helpers import gap, gpu_llm, hf_prompt_logprobs
    from helpers import tiny_qwen2, vllm_prompt_logprobs
    from vllm.v1.engine.core_client import InprocClient

    from lightning_vllm import VLLMUpdater

    llm = gpu_llm(Path(model_dir))
    assert isinstance(llm.llm_engine.engine_core, InprocClient)
    model = tiny_qwen2(seed=21).cuda()
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)
    updater.push_weights(model)
    updater.push_weights(model)
    measured = gap(vllm_prompt_logprobs(llm), hf_prompt_logprobs(model))
    print(json.dumps({"version": llm.get_weight_version(), "gap": measured}))
    updater.close()


if __name__ == "__main__":
    main(sys.argv[1])
