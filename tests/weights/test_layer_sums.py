"""Per-layer sums: the same across vLLM's layouts, different after one element changes, combined over ranks."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from lightning_vllm.core.landing_check import HeldSums
from lightning_vllm.weights import cpu_loops, layer_sums
from lightning_vllm.weights.held_sums import NOT_PACKED_HERE, LayerRows, held_layer_sums
from lightning_vllm.weights.layer_sums import (
    SQUARES_MODULUS,
    LayerSums,
    SentSums,
    layer_key,
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


def _reference(values: torch.Tensor) -> list[int]:
    """The fingerprint as its definition says, one value at a time in Python (``tensor_sums``'s docstring): on a
    CPU, the squares' sum modulo 2**32."""
    as_float32 = values.reshape(-1).float()
    bits = [int.from_bytes(struct.pack("<f", value), "little", signed=True) for value in as_float32.tolist()]
    squares = [int.from_bytes(struct.pack("<f", value * value), "little", signed=True) for value in as_float32.tolist()]
    return [sum(bits), sum(squares) % SQUARES_MODULUS, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_sums_are_the_exact_sums_of_the_float32_bit_patterns(dtype):
    values = torch.randn(300, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert tensor_sums(values).tolist() == _reference(values)
    # A value held in another dtype that represents it (vLLM keeping a bfloat16 value as float32) sums the same.
    assert tensor_sums(values.float()).tolist() == tensor_sums(values).tolist()


@pytest.mark.parametrize("numel", [17, 4096, 3 * 4096, 3 * 4096 + 17])
def test_the_gpus_row_split_adds_up_to_the_sums_of_every_value(numel):
    from lightning_vllm.weights.gpu_sums import _sums_kernel, row_sums

    values = torch.randn(numel, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    bits, squares, not_finite = row_sums(values, _sums_kernel).tolist()  # (the squares' sum exact in int64)
    assert [bits, squares % SQUARES_MODULUS, not_finite] == tensor_sums(values).tolist() == _reference(values)
    assert LayerSums(*tensor_sums(values).tolist()[:2]).matches(bits, squares)


def test_a_chunk_of_the_largest_bfloat16_bit_patterns_sums_exactly():
    # The CPU adds bfloat16 patterns in int32 over rows of 2**16 (a whole chunk of 2**18), the rest in int64: the
    # largest finite pattern overflows neither.
    count = 2**18 + 2**16 + 3
    largest = torch.full((count,), 0x7F7F, dtype=torch.int16).view(torch.bfloat16)
    bits, _, not_finite = tensor_sums(largest).tolist()
    assert bits == (0x7F7F << 16) * count
    assert not_finite == count  # (their squares overflow float32)
    assert tensor_sums(-largest).tolist()[0] == (0x7F7F << 16 | 0x80000000) * count - 2**32 * count


def test_a_layer_negated_whole_is_named():
    hf = _hf_layer(torch.Generator().manual_seed(9))
    engine = _vllm_layout(hf)
    with torch.no_grad():
        engine.model.embed_tokens.weight.neg_()  # (the squares cannot tell: the bits' sum does)
    held = HeldSums.combine([held_layer_sums(engine)])
    assert held.differing(_sent(hf).by_layer()) == ["model.embed_tokens"]


def test_non_finite_squares_are_counted():
    values = torch.tensor([1.0, math.nan, math.inf, 3e19, 2.0])  # (3e19 squared overflows float32)
    assert tensor_sums(values).tolist()[2] == 3


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
    sent.commit()
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


def test_one_element_one_step_off_is_named():
    hf = _hf_layer(torch.Generator().manual_seed(2))
    engine = _vllm_layout(hf)
    with torch.no_grad():
        weight = engine.model.layers[0].self_attn.qkv_proj.weight
        weight[5, 3] = torch.nextafter(weight[5, 3], torch.tensor(math.inf))
    held = HeldSums.combine([held_layer_sums(engine)])
    assert held.differing(_sent(hf).by_layer()) == ["model.layers.0.self_attn"]


def test_steps_that_cancel_in_the_bit_sum_are_named_by_the_squares():
    hf = _hf_layer(torch.Generator().manual_seed(7))
    engine = _vllm_layout(hf)
    with torch.no_grad():
        weight = engine.model.layers[0].self_attn.qkv_proj.weight
        up, down = weight[0, 0].abs() + 1, weight[0, 1].abs() + 1  # two positive values: one bit step each way
        weight[0, 0], weight[0, 1] = up, down
    sent = _hf_layer(torch.Generator().manual_seed(7))
    sent["model.layers.0.self_attn.q_proj.weight"][0, 0] = torch.nextafter(up, torch.tensor(-math.inf))
    sent["model.layers.0.self_attn.q_proj.weight"][0, 1] = torch.nextafter(down, torch.tensor(math.inf))
    held = HeldSums.combine([held_layer_sums(engine)])
    expected = _sent(sent).by_layer()
    assert held.layers["model.layers.0.self_attn"][0] == expected["model.layers.0.self_attn"].total
    assert held.differing(expected) == ["model.layers.0.self_attn"]


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


def test_an_emptied_parameter_packed_before_any_load_makes_its_layer_unverifiable_not_different():
    hf = _hf_layer(torch.Generator().manual_seed(4))
    engine = _vllm_layout(hf)
    engine.model.layers[0].self_attn.qkv_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    held = HeldSums.combine([held_layer_sums(engine)])
    assert held.unverifiable == {"model.layers.0.self_attn": NOT_PACKED_HERE}
    assert held.differing(_sent(hf).by_layer()) == []
    assert "model.layers.0.input_layernorm" in held.layers


def test_a_quantized_parameter_makes_its_layer_unverifiable():
    engine = torch.nn.Module()
    engine.proj = _Owner(torch.zeros(4, 4))
    engine.proj.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    assert held_layer_sums(engine)["unverifiable"] == {"proj": "stored as torch.int8 (quantized)"}


def test_sums_sent_earlier_count_until_sent_again_and_a_failed_push_leaves_them():
    one, two = tensor_sums(torch.ones(3)).tolist(), tensor_sums(torch.full((3,), 2.0)).tolist()
    sent = SentSums()
    sent.tally("model.layers.0.mlp.up_proj.weight", torch.ones(3))
    sent.tally("model.layers.0.mlp.down_proj.weight", torch.ones(3))
    sent.commit()
    sent.tally("model.layers.0.mlp.up_proj.weight", torch.full((3,), 2.0))  # a changed-only push: one tensor
    sent.dropped()  # ... that did not commit
    assert sent.by_layer()["model.layers.0.mlp"] == LayerSums(2 * one[0], 2 * one[1])
    sent.tally("model.layers.0.mlp.up_proj.weight", torch.full((3,), 2.0))
    sent.commit()
    assert sent.by_layer()["model.layers.0.mlp"] == LayerSums(one[0] + two[0], one[1] + two[1])


def test_held_sums_read_while_the_copies_run_are_what_the_commit_keeps_and_a_failed_push_forgets_them():
    name = "model.layers.0.mlp.up_proj.weight"
    weight = torch.ones(5)
    sent = SentSums()
    sent.tally(name, weight, held=True)
    sent.sum_held_meanwhile()
    sent.read_meanwhile()
    weight.fill_(3.0)  # (read already: the commit keeps what was read, not these)
    sent.commit()
    assert sent.by_layer()["model.layers.0.mlp"] == LayerSums(*tensor_sums(torch.ones(5)).tolist()[:2])
    sent.tally(name, weight, held=True)
    sent.sum_held_meanwhile()
    sent.read_meanwhile()
    sent.dropped()  # the push did not land: what was read is not kept, nor read into the next push
    sent.tally(name, torch.full((5,), 2.0))
    sent.commit()
    assert sent.by_layer()["model.layers.0.mlp"] == LayerSums(*tensor_sums(torch.full((5,), 2.0)).tolist()[:2])


def test_the_same_values_in_another_layout_and_order_match_exactly():
    values = torch.randn(1_000_003, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    sent = LayerSums(*tensor_sums(values).tolist()[:2])
    pieces = [tensor_sums(chunk) for chunk in values.flip(0).split(4099)]  # shards, summed in another order
    assert sent.matches(*torch.stack(pieces).sum(0).tolist()[:2])
    assert not sent.matches(sent.total + 1, sent.squares)


def test_values_rounded_to_the_serving_dtype_a_chunk_at_a_time_sum_as_the_rounded_tensor():
    master = torch.randn(5_000_000, generator=torch.Generator().manual_seed(8))  # float32, more than one chunk
    rounded = master.to(torch.bfloat16)
    assert tensor_sums(master, torch.bfloat16).tolist() == tensor_sums(rounded).tolist()
    assert tensor_sums(master, torch.bfloat16).tolist() != tensor_sums(master).tolist()
    assert torch.equal(master.to(torch.bfloat16), rounded)  # the master weights were not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rounded_to", [None, torch.bfloat16, torch.float16])
def test_the_compiled_pass_and_numpys_passes_give_the_fingerprint_by_its_definition(dtype, rounded_to, monkeypatch):
    # Lengths past a chunk (2**18) with a tail; special values (a square that overflows, NaN, infinities, subnormals,
    # minus zero) in the first chunk and in the tail; a small tensor against the definition, value by value.
    values = torch.randn(2**18 + 4099, generator=torch.Generator().manual_seed(3)).to(dtype)
    special = torch.tensor([math.nan, math.inf, -math.inf, 3e19, -0.0, 1e-40, -2e-39, 60000.0], dtype=dtype)
    values[100 : 100 + len(special)] = special
    values[-len(special) :] = special
    small = torch.tensor([1.5, -0.0, 1e-40, -2e-39, 60000.0, -3.25], dtype=dtype)
    reference = _reference(small.to(rounded_to) if rounded_to is not None else small)
    compiled, numpys = cpu_loops.compiled_loops(), (cpu_loops._numpy_sums, cpu_loops._numpy_sums)
    assert compiled != numpys  # (numba comes with vLLM, which the tests install)
    found = []
    for loops in (compiled, numpys):
        monkeypatch.setattr(layer_sums, "compiled_loops", lambda loops=loops: loops)
        found.append([layer_sums.cpu_sums(tensor, rounded_to).tolist() for tensor in (values, small)])
        assert found[-1][1] == reference
    assert found[0] == found[1]
    if rounded_to is not None:  # (a rounded copy's sums are the rounded values')
        assert found[0][0] == layer_sums.cpu_sums(values.to(rounded_to), None).tolist()


def test_layer_rows_hold_what_the_report_holds_of_every_layer_read_live_or_taken_as_written():
    hf = _hf_layer(torch.Generator().manual_seed(11))
    engine = _vllm_layout(hf)
    report = held_layer_sums(engine)
    layers_by_key = {layer_key(layer): layer for layer in report["replicated"]}
    rows = LayerRows.for_model(engine, written={})
    assert rows is not None and sorted(rows.layers) == sorted(report["replicated"])
    assert LayerRows.report(rows.rows(None).tolist(), layers_by_key)["replicated"] == report["replicated"]
    # The qkv weight's sums taken as a load wrote it: its row of the load's sums stands for a read of it.
    qkv = engine.model.layers[0].self_attn.qkv_proj.weight
    written = torch.stack([torch.zeros(3, dtype=torch.int64), tensor_sums(qkv)])
    rows = LayerRows.for_model(engine, written={"model.layers.0.self_attn.qkv_proj.weight": [1]})
    assert rows is not None
    with torch.no_grad():
        qkv.add_(1.0)  # (not read again: the load's sums are)
    held = LayerRows.report(rows.rows(written).tolist(), layers_by_key)
    assert held["replicated"] == report["replicated"]
    # A layer the reader never sent is left out; a tensor-parallel shard or a layer that cannot be verified makes
    # the report more than rows.
    assert "model.embed_tokens" not in LayerRows.report(rows.rows(written).tolist(), {})["replicated"]
    assert LayerRows.for_model(_vllm_layout(hf, 0, 2), written={}) is None
    quantized = torch.nn.Module()
    quantized.proj = _Owner(torch.zeros(4, 4, dtype=torch.int8))
    assert LayerRows.for_model(quantized, written={}) is None


def test_a_layer_key_is_the_same_in_every_process():
    # BLAKE2b of the name, not Python's hash (salted per process): a value fixed here is the value in any process.
    assert layer_key("model.layers.3.mlp") == -3326317436983934966 != layer_key("model.layers.3.mlp.experts.0")
