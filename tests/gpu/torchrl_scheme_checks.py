"""What the GPU tier asserts of TorchRL's documented weight-sync-scheme usage on one engine
(``torchrl_collectors.documented_scheme_usage``), over whichever backend the engine was built with."""

from __future__ import annotations

from typing import Any

from gpu_helpers import FIGURES, digests_equal, engine_digest, model_digest
from helpers import tiny_qwen2
from scenarios import FLOOR_BOUND
from torchrl_collectors import assert_in_step, documented_scheme_usage


def assert_the_scheme_keeps_vllm_and_the_collector_in_step(llm: Any, label: str) -> None:
    """Two pushes of a model trained in between, in step (``torchrl_collectors.assert_in_step``) within the engine's
    float32 floor on the GPU (``FLOOR_BOUND``; the CPU tier holds them to 1e-4), the last landed digest-equal.

    The training step is small (``lr=0.01``) because that floor holds only at the logits' scale it was measured at:
    vLLM's Triton attention computes float32 dots in TF32, whose error grows with the logits. At the CPU tier's
    ``lr=0.5`` (2026-12-05, H100) the step moved the response log-probs by 9.4 nats and the next push served them
    1.3e-3 from the model's, over both backends, with every weight digest-equal: the floor, not the push."""
    from lightning_vllm.torchrl import VLLMWeightSyncScheme

    model = tiny_qwen2(seed=72).cuda().eval()
    scheme = VLLMWeightSyncScheme(gpus_per_replica=1, num_replicas=1)
    records = documented_scheme_usage(llm, model, scheme, lr=0.01)
    landed = digests_equal(engine_digest(llm), model_digest(model))
    FIGURES[f"torchrl_scheme_{label}"] = {"pushes": records, "landed_digest_equal": landed}
    print(f"torchrl scheme over {label}: {records}; landed digest-equal: {landed}")
    assert_in_step(records, FLOOR_BOUND)
    assert landed
