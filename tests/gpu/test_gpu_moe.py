"""Mixture-of-Experts policies pushed over ``lightning_ipc`` into vLLM's own engine on one GPU.

transformers 5 holds a MoE layer's experts fused (``mlp.experts.gate_up_proj``, ``down_proj``); a push sends
them in the checkpoint's layout, one tensor per expert and projection, as views of the fused tensors
(``weights/checkpoint_layout.py``), and vLLM's loaders fuse them again (``w13_weight``, ``w2_weight``). vLLM
runs them with its Triton fused-MoE kernel there, around the torch-native routing stand-ins of
``tests/gpu/host/vllm_native_C.py``.

- A tiny float32 Qwen3-MoE trained by ``Trainer.fit`` with ``VLLMWeightSync``: served within 2x the engine's
  own float32 floor after the sync (``gpu_helpers.fit_lands_within_the_floor``). Its engine starts with
  ``TRITON_F32_DEFAULT=ieee``: Triton's float32 dots in TF32 (its default) would raise that floor.
- A bf16 MoE of 10.6B parameters of Qwen3-30B-A3B's layer shape (16 of its 48 layers), the engine from dummy
  weights: every push lands exactly (digests), each tensor's handle goes once. Its figures:
  ``moe_10b_*`` in ``gpu_figures.json``.

The digests (float64 sums over every parameter, ``gpu_helpers.engine_digest``) hold the trainer's fused
experts against vLLM's as they are: both hold the same values, in other tensors.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    MOE_FAMILY,
    digests_equal,
    dummy_bf16_llm,
    engine_digest,
    fit_lands_within_the_floor,
    model_digest,
    moe_llm_over,
    moe_policy,
    qwen3_moe_bf16,
    stop_llm,
    trainer_engine,
    worker_state,
)

from lightning_vllm import VLLMUpdater
from lightning_vllm.weights import weights_from

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["lightning_ipc", "ipc"])
def moe_llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, insecure_serialization):
    """A float32 ``vllm.LLM`` of the tiny MoE over ``lightning_ipc`` (ours) or ``ipc`` (vLLM's), stopped after its
    one test (its GPU memory goes back before the 10B model's)."""
    llm = moe_llm_over(request.param, tmp_path_factory.mktemp(f"tiny-{MOE_FAMILY}-gpu"))
    yield llm
    stop_llm(llm)


def test_fit_pushes_of_a_moe_policy_land_within_the_engines_own_float32_floor(moe_llm, tmp_path):
    model = moe_policy()
    if hasattr(model, "set_experts_implementation"):  # transformers 5: fused in memory, sent one expert at a time
        assert len(weights_from(model).metadata) > len(list(model.parameters()))
    backend = moe_llm.llm_engine.vllm_config.weight_transfer_config.backend
    fit_lands_within_the_floor(moe_llm, tmp_path, figures_prefix=f"moe_{backend}_", model=model)


def test_every_push_of_a_10b_bf16_moe_over_lightning_ipc_lands_exactly(tmp_path: Path, insecure_serialization):
    model = qwen3_moe_bf16(tmp_path)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_tensors = len(weights_from(model).metadata)  # each routed expert's projections apart
    FIGURES.update(
        moe_10b_parameters=sum(p.numel() for p in model.parameters()), moe_10b_bytes=num_bytes,
        moe_10b_tensors_sent=num_tensors,
    )  # fmt: skip
    assert FIGURES["moe_10b_parameters"] >= 10e9
    llm = updater = None
    try:
        llm = dummy_bf16_llm(tmp_path, num_bytes, backend="lightning_ipc")
        assert not digests_equal(engine_digest(llm), model_digest(model))  # the check can fail
        updater = VLLMUpdater(engine=llm, timeout_seconds=300)
        pushes, walls = [], []
        for push in range(1, 5):
            with torch.no_grad():  # a stand-in optimizer step: moves most bf16 values
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=1e-3)
            started = time.perf_counter()
            stats = updater.push_weights(model)
            walls.append(time.perf_counter() - started)
            pushes.append(stats.seconds)
            FIGURES[f"moe_10b_push_{push}_seconds"] = stats.seconds  # the first joins and opens every handle
            assert digests_equal(engine_digest(llm), model_digest(model)), f"push {push} did not land exactly"
            assert llm.get_weight_version() == str(stats.weight_version)
            assert stats.num_bytes == num_bytes  # every expert sent, once
        slots, replayed = worker_state(llm)
        handles = trainer_engine(updater).handles_sent
        FIGURES.update(
            moe_10b_push_seconds_median=statistics.median(pushes[1:]),
            moe_10b_push_wall_seconds_median=statistics.median(walls[1:]),
            moe_10b_handles_sent=handles,
            # Loads replayed from lightning_ipc's recorded copies (lightning_ipc/recorded_loads.py tells the views
            # of one fused tensor apart by their bytes): every push after the first, without vLLM's loaders.
            moe_10b_loads_replayed=replayed,
        )
        assert replayed >= 3
        assert handles == slots == num_tensors  # a handle per tensor at the first push only: the storages stayed put
    finally:
        if updater is not None:
            updater.close()
        if llm is not None:
            stop_llm(llm)
        del model, updater  # (a failure's traceback keeps this frame: not its 21 GB)
        gc.collect()
        torch.cuda.empty_cache()
