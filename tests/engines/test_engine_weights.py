"""The check before any byte moves, for engines started as RL stacks start them: from a hub id (read from the local
Hugging Face cache, offline) and with ``load_format="dummy"`` from a folder holding only the config (checked against
the config's model on the meta device; the first push fills the engine)."""

from __future__ import annotations

import pytest
from helpers import assert_serves, build_llm, shutdown, tiny_qwen2
from transformers import Qwen2ForCausalLM

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import WeightsMismatchError

pytestmark = pytest.mark.engine


def _wider_mlp(tie_word_embeddings: bool) -> Qwen2ForCausalLM:
    """The tiny model with twice its MLP's width: names alike, six shapes not."""
    config = tiny_qwen2(tie_word_embeddings=tie_word_embeddings).config
    config.intermediate_size *= 2
    return Qwen2ForCausalLM(config).float().eval()


def _refused_then_filled(llm, tie_word_embeddings: bool = False) -> None:
    version = llm.get_weight_version()
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)
    with pytest.raises(WeightsMismatchError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape"):
        updater.push_weights(_wider_mlp(tie_word_embeddings))
    assert llm.get_weight_version() == version  # (nothing sent, nothing committed)
    model = tiny_qwen2(seed=5, tie_word_embeddings=tie_word_embeddings)
    updater.push_weights(model)
    assert_serves(llm, model)
    updater.close()


def test_an_engine_started_from_a_hub_id_refuses_a_mismatched_model_before_a_byte_moves(hub_llm):
    _refused_then_filled(hub_llm, tie_word_embeddings=True)  # (read from the cache: its checkpoint ties them)


def test_a_dummy_engine_with_no_checkpoint_refuses_a_mismatched_model_and_the_first_push_fills_it(tmp_path):
    tiny_qwen2().config.save_pretrained(tmp_path)  # (config.json alone)
    llm = build_llm(tmp_path, load_format="dummy")
    try:
        _refused_then_filled(llm)
    finally:
        shutdown(llm)
