"""A bf16 model of Qwen2.5-1.5B's shape (1.54B parameters, tied embeddings) pushed over ipc into vLLM's
own engine, started from dummy weights: after every push the engine holds exactly the trainer's weights."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import FIGURES, digests_equal, engine_digest, gpu_llm, model_digest, stop_llm

from lightning_vllm import VLLMUpdater

pytestmark = pytest.mark.gpu

# Qwen2.5-1.5B's shape; its vocabulary (151936 = 64 x 2374) needs no padding in vLLM's embedding,
# whose padded rows would hold dummy values no push writes.
SHAPE = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0,
)  # fmt: skip


def test_every_push_of_a_1_5b_bf16_model_lands_exactly(tmp_path, insecure_serialization):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    config.save_pretrained(tmp_path)  # all vLLM's dummy loader reads
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    llm = gpu_llm(tmp_path, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.1)
    try:
        num_parameters = sum(p.numel() for p in model.parameters())
        assert 1.5e9 < num_parameters < 1.6e9
        assert not digests_equal(engine_digest(llm), model_digest(model))  # the check can fail
        updater = VLLMUpdater(engine=llm, timeout_seconds=120)
        seconds = []
        for round_ in range(4):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=1e-3)
            stats = updater.push_weights(model)
            seconds.append(stats.seconds)
            assert digests_equal(engine_digest(llm), model_digest(model)), f"push {round_ + 1} did not land exactly"
            assert llm.get_weight_version() == str(stats.weight_version)
        FIGURES.update(bf16_1_5b_parameters=num_parameters, bf16_1_5b_push_seconds_median=sorted(seconds)[2])
        updater.close()
    finally:
        stop_llm(llm)
