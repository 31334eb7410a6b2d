"""How many of the package's modules one steady-state ``lightning_ipc`` push runs through, on vLLM's own engine on
one GPU (``push_trace.py``; the ``gloo`` push's count is ``tests/test_push_path.py``'s). The house we head for
(issue 45) takes a push through at most 17, and the check after every push, on by default since issue 46, adds its
two (``core/landing_check``, ``weights/layer_sums``): 17 with them (issue 65), the bound below."""

from __future__ import annotations

import sys

import pytest
from gpu_helpers import FIGURES, digests_equal, engine_digest, gpu_trainer, model_digest
from helpers import TinyCausalLM, tiny_qwen2, token_batches
from push_trace import TRACED_STEP, ModulesEntered, TracedSync, assert_few_modules_and_no_call_up, calls_up

pytestmark = pytest.mark.gpu

MOST_MODULES_AN_IPC_PUSH_ENTERS = 17


@pytest.mark.skipif(sys.version_info < (3, 12), reason="traced in process with sys.monitoring (Python 3.12)")
def test_a_steady_state_lightning_ipc_push_runs_through_few_modules(lightning_ipc_llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=61))
    tracer = ModulesEntered()
    tracer.install()
    try:
        sync = TracedSync(tracer, engine=lightning_ipc_llm, every_n_train_steps=1, timeout_seconds=120)
        gpu_trainer(tmp_path, [sync], max_steps=TRACED_STEP + 1).fit(module, token_batches(TRACED_STEP + 1))
    finally:
        tracer.uninstall()
    modules = sorted(tracer.entered)
    found = {"modules": modules, "calls": sorted(tracer.calls)}
    FIGURES.update(
        lightning_ipc_push_modules=len(modules),
        lightning_ipc_push_module_names=modules,
        lightning_ipc_push_calls_up=calls_up(found["calls"]),
    )
    print(f"A steady-state lightning_ipc push entered {len(modules)} modules: {modules}")
    assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(module.hf))  # the pushes landed
    assert_few_modules_and_no_call_up(
        found, "lightning_vllm.backends.lightning_ipc.trainer", MOST_MODULES_AN_IPC_PUSH_ENTERS
    )
