"""The checks on engines as users and RL stacks start them, with no flag: the README's engine exactly as the README
builds it (its engine core in a process of its own, no ``worker_extension_cls``) checked after every push over every
layer, as AsyncLLM, vllm serve and Ray are; an engine started from a hub id with ``load_format="dummy"`` (how verl and
SkyRL start theirs: the first push fills it) refuses a mismatched model before a byte moves; faults in vLLM's real
worker are named by layer at the push that made them."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import (
    TinyCausalLM,
    assert_serves,
    build_llm_in_process,
    cpu_trainer,
    fake_hub_cache,
    save_model,
    save_tokenizer,
    served_version,
    shutdown,
    tiny_qwen2,
    token_batches,
)
from transformers import Qwen2ForCausalLM

from lightning_vllm import VLLMUpdater, VLLMWeightSync
from lightning_vllm.errors import LandedWeightsMismatchError, WeightsMismatchError

pytestmark = pytest.mark.engine

UNCHECKED = ("not checked", "cannot be verified", "could not be checked")
# The tiny model's layers, as the check names them: per decoder layer its attention, MLP and two norms; the embedding,
# the final norm and the head.
LAYERS = 2 * 4 + 3


def _said_unchecked(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith("lightning_vllm") and any(words in record.getMessage() for words in UNCHECKED)
    ]


def test_the_readmes_engine_is_checked_after_every_push_with_no_flag(tmp_path, caplog, monkeypatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    checkpoint_dir = save_tokenizer(save_model(tiny_qwen2(seed=0), tmp_path / "model"))
    llm = LLM(model=str(checkpoint_dir), dtype="float32", weight_transfer_config={"backend": "gloo"})  # (the README)
    try:
        module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
        sync = VLLMWeightSync(engine=llm, every_n_train_steps=4)
        trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
        with caplog.at_level(logging.INFO, logger="lightning_vllm"):
            trainer.fit(module, token_batches(num_batches=4))
        assert _said_unchecked(caplog) == []
        # Fit start and step 4: each checked (the engine's workers summed every layer, packed ones included).
        assert sync.weight_version == 2
        assert sync.updater.last_sync is not None and sync.updater.last_sync.timing.check_seconds > 0
        assert sync.updater.last_sync.checked_layers == (LAYERS, LAYERS)  # every layer, the packed ones included
        module.hf.eval()
        assert_serves(llm, module.hf)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def hub_llm(tmp_path_factory):
    """A ``vllm.LLM`` started from a hub id, ``org/tiny-qwen2``, with ``load_format="dummy"``: the Hugging Face cache
    made here holds its config alone (offline: nothing is fetched). Its model ties the output embedding to the input
    embedding (vLLM's CPU build packs the head apart); its workers have the tests' probe."""
    config = tiny_qwen2(tie_word_embeddings=True).config
    cache = fake_hub_cache(tmp_path_factory.mktemp("hub"), "org/tiny-qwen2", config=config)
    with pytest.MonkeyPatch.context() as patch:
        import huggingface_hub.constants

        patch.setenv("HF_HUB_CACHE", str(cache))  # (vLLM's engine process reads it as it starts)
        patch.setenv("HF_HUB_OFFLINE", "1")
        # (this process read both at import: vLLM's front end and the check resolve the hub id here too)
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        engine = build_llm_in_process(
            "org/tiny-qwen2", load_format="dummy", worker_extension_cls="worker_probe.WorkerProbe"
        )
        yield engine
    shutdown(engine)


def _wider_mlp() -> Qwen2ForCausalLM:
    """The tiny model with twice its MLP's width: names alike, six shapes not."""
    config = tiny_qwen2(tie_word_embeddings=True).config
    config.intermediate_size *= 2
    return Qwen2ForCausalLM(config).float().eval()


def test_a_dummy_engine_from_a_hub_id_refuses_a_mismatched_model_and_the_first_push_fills_it(hub_llm):
    version = hub_llm.get_weight_version()
    updater = VLLMUpdater(engine=hub_llm, timeout_seconds=60)
    with pytest.raises(WeightsMismatchError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape"):
        updater.push_weights(_wider_mlp())  # (checked against the config's model on the meta device)
    assert hub_llm.get_weight_version() == version  # (nothing sent, nothing committed)
    model = tiny_qwen2(seed=5, tie_word_embeddings=True)
    updater.push_weights(model)  # (the same updater: the refused model's metadata is not kept)
    assert_serves(hub_llm, model)
    updater.close()


@pytest.mark.parametrize("kind", ["async_engine", "server", "actor"])
def test_every_engine_kind_is_checked_over_every_layer_with_no_flag(kind, request, caplog):
    engine = request.getfixturevalue(kind)  # (the shared engines: built with no worker extension)
    updater = VLLMUpdater(engine=engine.url if kind == "server" else engine, timeout_seconds=60)
    with caplog.at_level(logging.INFO, logger="lightning_vllm"):
        for _ in range(2):
            stats = updater.push_weights(tiny_qwen2(seed=0))  # (what the shared engines started from)
            assert stats.checked_layers == (LAYERS, LAYERS)
    assert _said_unchecked(caplog) == []
    updater.close()


@pytest.mark.parametrize(
    ("fault", "layer"),
    [
        # one value of a linear layer negated after the loader copied it, before vLLM packed it
        (("flip_at_next_load", "model.layers.1.mlp.down_proj"), "model.layers.1.mlp"),
        # the tied head left computing with the pack of its old values, as vLLM 0.32's own reload leaves it
        (("leave_tied_packs_stale_once",), "lm_head"),
    ],
)
def test_a_fault_in_vllms_worker_is_named_by_layer_at_that_push(hub_llm, fault, layer, caplog):
    model = tiny_qwen2(seed=41, tie_word_embeddings=True)
    updater = VLLMUpdater(engine=hub_llm, timeout_seconds=60)  # (checked: the default)
    with caplog.at_level(logging.INFO, logger="lightning_vllm"):
        updater.push_weights(model)  # every tensor: the engine's packs are fingerprinted as vLLM builds them
        assert_serves(hub_llm, model)
        version = served_version(hub_llm)
        with torch.no_grad():  # (a training step: every weight moves a little)
            for parameter in model.parameters():
                parameter.mul_(1.01)
        hub_llm.collective_rpc(fault[0], args=fault[1:])
        with pytest.raises(LandedWeightsMismatchError) as caught:
            updater.push_weights(model)
        assert caught.value.layers == {0: [layer]}
        assert layer in str(caught.value)
        assert served_version(hub_llm) == version + 1  # (the version committed: the engine holds it, wrongly)
        # The next push sends every tensor again, and the engine serves the model.
        updater.push_weights(model)
        assert_serves(hub_llm, model)
    assert _said_unchecked(caplog) == []
    updater.close()
