"""The check after every push, on a real vLLM engine: a layer corrupted inside the engine is named."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_serves, tiny_qwen2

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import LandedWeightsMismatchError

NORM = "model.layers.1.post_attention_layernorm"


@pytest.mark.engine
def test_a_layer_corrupted_in_the_engine_is_named_by_the_next_push_and_mended_by_the_one_after(llm, caplog):
    model = tiny_qwen2(seed=41)
    updater = VLLMUpdater(engine=llm, timeout_seconds=60, verify_pushes=True)
    with caplog.at_level(logging.WARNING, logger="lightning_vllm.core.landing_check"):
        updater.push_weights(model)
        updater.push_weights(model)
    assert updater.last_sync is not None and updater.last_sync.timing.check_seconds > 0
    # vLLM's CPU build repacks the linear layers: said once, and the rest is checked.
    said = [record.getMessage() for record in caplog.records if "cannot be verified" in record.getMessage()]
    assert len(said) == 1
    assert "model.layers.0.self_attn: held in another form" in said[0] and "model.layers.1.mlp" in said[0]
    assert NORM not in said[0]
    version = updater.weight_version

    # A faulty load behind the trainer's back, then a changed-only push of another layer.
    (value,) = llm.collective_rpc("add_to_parameter", args=(f"{NORM}.weight", 0.5))
    assert value == pytest.approx(1.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)
    with pytest.raises(LandedWeightsMismatchError, match=rf"engine 0 .*1 layer\(s\), {NORM}\b") as caught:
        updater.push_weights(model)
    assert caught.value.layers == {0: [NORM]}
    assert caught.value.stats.num_bytes < sum(p.numel() * p.element_size() for p in model.parameters())
    # Committed (the engine holds that version), and the next push sends every tensor again.
    assert updater.weight_version == version + 1 and llm.get_weight_version() == str(version + 1)
    updater.push_weights(model)
    assert updater.last_sync.num_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert_serves(llm, model)
    updater.close()


@pytest.mark.engine
def test_without_verify_pushes_nothing_is_checked(llm):
    model = tiny_qwen2(seed=42)
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)  # verify_pushes=False: the default
    updater.push_weights(model)
    assert updater.last_sync is not None and updater.last_sync.timing.check_seconds < 1e-3
    (value,) = llm.collective_rpc("add_to_parameter", args=(f"{NORM}.weight", 0.5))
    updater.push_weights(model)  # nothing changed on the trainer: nothing sent, nothing noticed
    updater.close()
    VLLMUpdater(engine=llm, timeout_seconds=60, verify_pushes=True).push_weights(model)  # a new connection: all
    assert_serves(llm, model)
