"""Per-layer sums: the same across vLLM's layouts, different after one element changes, combined over ranks."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vllm.weights.layer_sums import (
    REPACKED,
    HeldSums,
    LayerSums,
    SentSums,
    held_layer_sums,
    layer_of,
    tensor_sums,
)


def test_a_layer_is_the_block_after_the_decoder_layers_index_or_the_module():
    assert layer_of("model.layers.11.mlp.gate_proj.weight") == "model.layers.11.mlp"
    assert layer_of("model.layers.11.mlp.gate_up_proj.base_layer.weight") == "model.layers.11.mlp"
    assert layer_of("model.layers.2.input_layernorm.weight") == "model.layers.2.input_layernorm"
    # vLLM fuses a block's routed experts into one module, an expert a row: each expert is a layer (the engine's
    # side sums its rows apart), apart from the router.
    assert layer_of("model.layers.2.mlp.experts.7.w1.weight") == "model.layers.2.mlp.experts.7"
    assert layer_of("model.layers.2.mlp.experts.w13_weight") == "model.layers.2.mlp.experts"
    assert layer_of("model.layers.2.mlp.gate.weight") == "model.layers.2.mlp.gate"
    assert layer_of("model.norm.weight") == "model.norm"
    assert layer_of("lm_head.weight") == "lm_head"
    assert layer_of("bias") == "bias"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_sums_are_the_float64_sums_of_the_values(dtype):
    values = torch.randn(3000, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    reference = values.double()
    total, squares = tensor_sums(values).tolist()
    assert total == pytest.approx(float(reference.sum()), rel=1e-14, abs=1e-12)
    assert squares == pytest.approx(float((reference * reference).sum()), rel=1e-14)


@pytest.mark.parametrize("numel", [17, 4096, 3 * 4096, 3 * 4096 + 17])
def test_the_gpus_row_split_adds_up_to_the_sums_of_every_value(numel):
    from lightning_vllm.weights.layer_sums import _sums_kernel, row_sums

    values = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    total, squares = row_sums(values, _sums_kernel).tolist()
    assert total == pytest.approx(float(values.sum()), rel=1e-12, abs=1e-12)
    assert squares == pytest.approx(float((values * values).sum()), rel=1e-12)


def _hf_layer(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=generator),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(16, 32, generator=generator),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(16, 32, generator=generator),
        "model.layers.0.input_layernorm.weight": torch.rand(32, generator=generator) + 0.5,
        "model.embed_tokens.weight": torch.randn(100, 32, generator=generator),
    }


class _Owner(torch.nn.Module):
    """A module holding one parameter, with the attributes vLLM's parallel layers have."""

    def __init__(self, tensor: torch.Tensor, tp_size: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(tensor.clone(), requires_grad=False)
        if tp_size is not None:
            self.tp_size = tp_size


def _vllm_layout(hf: dict[str, torch.Tensor], rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    """The same weights as vLLM holds them: q/k/v fused, the vocabulary padded with zero rows,
    the fused and embedding tensors split over ``tp_size`` ranks (this rank's part)."""
    qkv = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    embedding = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(28, 32)])

    def shard(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(tp_size)[rank]

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = _Owner(shard(qkv), tp_size)
    layer.input_layernorm = _Owner(hf["model.layers.0.input_layernorm.weight"])
    model.model.layers = torch.nn.ModuleList([layer])
    model.model.embed_tokens = _Owner(shard(embedding), tp_size)
    return model


def _sent(hf: dict[str, torch.Tensor]) -> SentSums:
    sent = SentSums()
    for name, tensor in hf.items():
        sent.tally(name, tensor)
    sent.landed()
    return sent


@pytest.mark.parametrize("tp_size", [1, 2])
def test_what_vllm_holds_in_its_own_layout_matches_what_was_sent(tp_size):
    hf = _hf_layer(torch.Generator().manual_seed(1))
    reports = [held_layer_sums(_vllm_layout(hf, rank, tp_size)) for rank in range(tp_size)]
    held = HeldSums.combine(reports)
    expected = _sent(hf).by_layer()
    assert (
        sorted(held.layers)
        == sorted(expected)
        == [
            "model.embed_tokens",
            "model.layers.0.input_layernorm",
            "model.layers.0.self_attn",
        ]
    )
    assert held.differing(expected) == []


def test_one_element_changed_by_a_thousandth_is_named():
    hf = _hf_layer(torch.Generator().manual_seed(2))
    engine = _vllm_layout(hf)
    with torch.no_grad():
        engine.model.layers[0].self_attn.qkv_proj.weight[5, 3] += 1e-3
    held = HeldSums.combine([held_layer_sums(engine)])
    assert held.differing(_sent(hf).by_layer()) == ["model.layers.0.self_attn"]


def test_a_nan_on_the_engine_is_named_and_a_nan_in_the_trainers_weights_is_not_checked():
    hf = _hf_layer(torch.Generator().manual_seed(3))
    engine = _vllm_layout(hf)
    with torch.no_grad():
        engine.model.layers[0].input_layernorm.weight[0] = math.nan
    assert HeldSums.combine([held_layer_sums(engine)]).differing(_sent(hf).by_layer()) == [
        "model.layers.0.input_layernorm"
    ]
    hf["model.layers.0.input_layernorm.weight"][0] = math.nan
    expected = _sent(hf).by_layer()
    assert not expected["model.layers.0.input_layernorm"].finite
    assert HeldSums.combine([held_layer_sums(engine)]).differing(expected) == []


def test_an_emptied_parameter_makes_its_layer_unverifiable_not_different():
    hf = _hf_layer(torch.Generator().manual_seed(4))
    engine = _vllm_layout(hf)
    engine.model.layers[0].self_attn.qkv_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    held = HeldSums.combine([held_layer_sums(engine)])
    assert held.unverifiable == {"model.layers.0.self_attn": REPACKED}
    assert held.differing(_sent(hf).by_layer()) == []
    assert "model.layers.0.input_layernorm" in held.layers


def test_a_quantized_parameter_makes_its_layer_unverifiable():
    engine = torch.nn.Module()
    engine.proj = _Owner(torch.zeros(4, 4))
    engine.proj.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    assert held_layer_sums(engine)["unverifiable"] == {"proj": "stored as torch.int8 (quantized)"}


def test_sums_sent_earlier_count_until_sent_again_and_a_failed_push_leaves_them():
    sent = SentSums()
    sent.tally("model.layers.0.mlp.up_proj.weight", torch.ones(3))
    sent.tally("model.layers.0.mlp.down_proj.weight", torch.ones(3))
    sent.landed()
    sent.tally("model.layers.0.mlp.up_proj.weight", torch.full((3,), 2.0))  # a changed-only push: one tensor
    sent.dropped()  # ... that did not commit
    assert sent.by_layer()["model.layers.0.mlp"] == LayerSums(6.0, 6.0, 6)
    sent.tally("model.layers.0.mlp.up_proj.weight", torch.full((3,), 2.0))
    sent.landed()
    assert sent.by_layer()["model.layers.0.mlp"] == LayerSums(9.0, 15.0, 6)


def test_sums_added_in_another_order_match_and_a_real_difference_does_not():
    values = torch.randn(1_000_003, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    in_order = LayerSums(float(values.sum()), float((values * values).sum()), values.numel())
    reversed_chunks = torch.stack([chunk.sum() for chunk in values.flip(0).split(4099)]).sum()
    assert in_order.matches(float(reversed_chunks), float((values.flip(0) ** 2).sum()))
    assert not in_order.matches(in_order.total + 1e-4, in_order.squares)
    assert not in_order.matches(in_order.total, in_order.squares * (1 + 1e-9))
