"""What ipc needs from an engine, on vLLM's own engine: refused at connect without
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (before a byte moves, naming the fix), and working without it when
the engine core runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). And nccl into an engine
on the trainer's own GPU, which NCCL cannot join: refused at the first push, naming what to use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_helpers import gpu_llm, stop_llm
from helpers import max_abs_diff, tiny_qwen2, vllm_prompt_logprobs

from lightning_vllm import EngineConfigError, VLLMUpdater

pytestmark = pytest.mark.gpu

VARIABLE = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def test_ipc_into_an_engine_built_without_the_variable_is_refused_at_connect_naming_the_fix(gpu_model_dir, monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    # CUDA in use first, as in training: vLLM then spawns its engine core, whose start environment /proc shows. (A
    # forked one, vLLM's choice before CUDA is used, is taken to share this process's: engines/serialization.py.)
    torch.zeros(1, device="cuda")
    llm = gpu_llm(gpu_model_dir)  # its engine core starts without the variable
    try:
        served = vllm_prompt_logprobs(llm)
        model = tiny_qwen2(seed=20).cuda()
        updater = VLLMUpdater(engine=llm, timeout_seconds=60)
        with pytest.raises(EngineConfigError, match=f"{VARIABLE}=1") as refused:
            updater.push_weights(model)
        message = str(refused.value)
        assert "before the engine is built" in message and "CUDA IPC handles" in message
        assert "docs/security.md" in message
        # Set in the trainer only once the engine runs: its engine core still lacks it, which is found out.
        monkeypatch.setenv(VARIABLE, "1")
        with pytest.raises(EngineConfigError, match="started without it"):
            updater.push_weights(model)
        assert llm.get_weight_version() == "default"  # nothing was committed, nothing moved
        assert max_abs_diff(vllm_prompt_logprobs(llm), served) < 1e-5  # and the engine serves what it served
        updater.close()
    finally:
        stop_llm(llm)


def test_ipc_into_an_engine_core_in_the_trainers_process_is_refused_at_connect(gpu_model_dir, tmp_path):
    """In a process of its own: an engine core in this process would freeze vLLM's environment here.

    Forced through (``in_process_core_run.py --force``, as before the refusal), the first push failed in
    vLLM's worker with ``CUDA error: invalid device context``: CUDA opens no IPC handle in the process
    that made it."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop(VARIABLE, None)
    script = Path(__file__).with_name("in_process_core_run.py")
    done = subprocess.run(
        [sys.executable, str(script), str(gpu_model_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    result_lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and result_lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_lines[-1])
    print("engine core in the trainer's process:", result)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in result["refused"] and "a process of its own" in result["refused"]
    assert result["version"] == "default" and result["gap_after"] < 1e-5  # nothing moved; it serves on


def test_nccl_into_an_engine_on_the_trainers_own_gpu_is_refused_naming_lightning_ipc(gpu_model_dir):
    """NCCL puts each rank of a group on a GPU of its own: with one GPU, vLLM's NCCL init fails on both sides
    (``Duplicate GPU detected``). The push says so, with the fix, and the engine serves on."""
    llm = gpu_llm(gpu_model_dir, backend="nccl")
    try:
        served = vllm_prompt_logprobs(llm)
        updater = VLLMUpdater(engine=llm, timeout_seconds=60)
        started = time.monotonic()
        with pytest.raises(
            EngineConfigError, match="backend='nccl' with a vLLM worker on the trainer's own GPU"
        ) as refused:
            updater.push_weights(tiny_qwen2(seed=21).cuda())
        print(f"nccl into an engine on the trainer's GPU: refused after {time.monotonic() - started:.2f} s")
        assert "'lightning_ipc'" in str(refused.value) and "Duplicate GPU detected" in str(refused.value.__cause__)
        assert llm.get_weight_version() == "default"  # nothing was committed
        assert max_abs_diff(vllm_prompt_logprobs(llm), served) < 1e-5  # and the engine serves what it served
        updater.close()
    finally:
        stop_llm(llm)
