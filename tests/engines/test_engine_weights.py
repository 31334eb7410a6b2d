"""The check before any byte moves, for engines started as RL stacks start them: from a hub id (read from the local
Hugging Face cache, offline) and with ``load_format="dummy"`` from a folder holding only the config (checked against
the config's model on the meta device; the first push fills the engine)."""

from __future__ import annotations

import pytest
from helpers import assert_serves, build_llm, fake_hub_cache, shutdown, tiny_qwen2
from transformers import Qwen2ForCausalLM

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import WeightsMismatchError

pytestmark = pytest.mark.engine


def _wider_mlp() -> Qwen2ForCausalLM:
    """The tiny model with twice its MLP's width: names alike, six shapes not."""
    config = tiny_qwen2().config
    config.intermediate_size *= 2
    return Qwen2ForCausalLM(config).float().eval()


def _refused_then_filled(llm) -> None:
    version = llm.get_weight_version()
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)
    with pytest.raises(WeightsMismatchError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape"):
        updater.push_weights(_wider_mlp())
    assert llm.get_weight_version() == version  # (nothing sent, nothing committed)
    model = tiny_qwen2(seed=5)
    updater.push_weights(model)
    assert_serves(llm, model)
    updater.close()


def test_an_engine_started_from_a_hub_id_refuses_a_mismatched_model_before_a_byte_moves(tmp_path, monkeypatch):
    cache = fake_hub_cache(tmp_path / "hub", "org/tiny-qwen2", model=tiny_qwen2(seed=0))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (vLLM and the check read the cache; nothing is fetched)
    llm = build_llm("org/tiny-qwen2")
    try:
        _refused_then_filled(llm)
    finally:
        shutdown(llm)


def test_a_dummy_engine_with_no_checkpoint_refuses_a_mismatched_model_and_the_first_push_fills_it(tmp_path):
    tiny_qwen2().config.save_pretrained(tmp_path)  # (config.json alone)
    llm = build_llm(tmp_path, load_format="dummy")
    try:
        _refused_then_filled(llm)
    finally:
        shutdown(llm)
