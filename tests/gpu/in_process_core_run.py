"""ipc into a ``vllm.LLM`` whose engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the
push is refused at connect, and the engine serves on. Run by ``test_gpu_refusals.py``; prints one JSON line.

With ``--force`` the refusal is skipped and the push goes to vLLM as it would without it (what the refusal
is for: on an H200 it failed in vLLM's worker with ``CUDA error: invalid device context``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))


def main(model_dir: str, force: bool) -> None:
    from gpu_helpers import gpu_llm
    from helpers import max_abs_diff, tiny_qwen2, vllm_prompt_logprobs
    from vllm.v1.engine.core_client import InprocClient

    from lightning_vllm import EngineConfigError, LocalLLMEngine, VLLMUpdater

    llm = gpu_llm(Path(model_dir))
    assert isinstance(llm.llm_engine.engine_core, InprocClient)
    served = vllm_prompt_logprobs(llm)
    engine = LocalLLMEngine(llm)
    if force:
        engine.ipc_handles_problem = lambda: None  # type: ignore[method-assign]
    model = tiny_qwen2(seed=21).cuda()
    updater = VLLMUpdater(engine=engine, timeout_seconds=60)
    refused = ""
    try:
        updater.push_weights(model)
    except EngineConfigError as error:
        refused = str(error)
    result = {"refused": refused, "version": llm.get_weight_version()}
    result["gap_after"] = max_abs_diff(vllm_prompt_logprobs(llm), served)
    print(json.dumps(result))
    updater.close()


if __name__ == "__main__":
    main(sys.argv[1], force="--force" in sys.argv)
