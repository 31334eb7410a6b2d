"""The check after a push into an FP8 engine (weights/online_sums.py, weights/held_sums.py): layers vLLM quantizes
online are held by the values it quantized them from, taken as it quantizes them; layers an FP8 checkpoint gave
e4m3 values and scales are held live, in that form, against what the trainer sent. vLLM's CPU build serves no FP8,
so vLLM's online method is taken as its class (its GPU kernels are not built here) and its quantization is ours,
bit for bit vLLM's (``weights/fp8.block_fp8``); ``make test-gpu-fp8`` runs both ways on vLLM's engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerBlockOnlineLinearMethod

from lightning_vllm.core.landing_check import HeldSums
from lightning_vllm.weights import online_sums
from lightning_vllm.weights.fp8 import FP8, block_fp8
from lightning_vllm.weights.held_sums import ONLINE_NOT_TAKEN, held_layer_sums
from lightning_vllm.weights.layer_sums import SentSums

QKV = ("q", "k", "v")


def _sent(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    sent = SentSums()
    for name, tensor in tensors.items():
        sent.tally(name, tensor)
    sent.commit()
    return sent.by_layer()


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q": (256, 128), "k": (128, 128), "v": (128, 128)}
    return {
        f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(shape, generator=generator).to(torch.bfloat16)
        for p, shape in shapes.items()
    }


class _OnlineLinear(torch.nn.Module):
    """vLLM's fused q/k/v projection as its online FP8 holds it: loaded in bf16, then e4m3 values and block scales."""

    def __init__(self, loaded: torch.Tensor) -> None:
        super().__init__()
        # (vLLM's class, not built: its __init__ picks GPU kernels. Only its type is read.)
        self.quant_method = Fp8PerBlockOnlineLinearMethod.__new__(Fp8PerBlockOnlineLinearMethod)
        self.weight = torch.nn.Parameter(loaded, requires_grad=False)

    def quantize(self) -> None:  # (what process_weights_after_loading does to the layer)
        values, scales = block_fp8(self.weight.detach())
        self.weight = torch.nn.Parameter(values, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)


def _engine(layer: torch.nn.Module, block: str = "self_attn", name: str = "qkv_proj") -> torch.nn.Module:
    """A vLLM model of one decoder layer holding ``layer`` as ``model.layers.0.<block>.<name>``."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    decoder = torch.nn.Module()
    decoder.add_module(block, torch.nn.Module())
    decoder.get_submodule(block).add_module(name, layer)
    model.model.layers = torch.nn.ModuleList([decoder])
    return model


@contextmanager
def _vllms_timing(layer: torch.nn.Module, quant_method: Any) -> Iterator[None]:  # (vLLM's only times the quantization)
    yield


def _quantized_online(layer: _OnlineLinear) -> None:
    with online_sums._fingerprinted(_vllms_timing)(layer, layer.quant_method):
        layer.quantize()


def test_a_layer_vllm_quantized_online_is_held_by_what_it_quantized_from():
    checkpoint = _checkpoint(seed=0)
    layer = _OnlineLinear(torch.cat([checkpoint[f"model.layers.0.self_attn.{p}_proj.weight"] for p in QKV]))
    _quantized_online(layer)
    assert layer.weight.dtype == FP8
    held = HeldSums.combine([held_layer_sums(_engine(layer))])
    assert held.unverifiable == {}
    assert held.differing(_sent(checkpoint)) == []  # (the e4m3 values and scales vLLM made are not compared)
    other = _sent(_checkpoint(seed=1))
    assert held.differing(other) == ["model.layers.0.self_attn"]


def test_a_quantization_that_raises_keeps_the_fingerprint_of_what_the_layer_held_before():
    layer = _OnlineLinear(torch.ones(128, 128, dtype=torch.bfloat16))
    _quantized_online(layer)
    before = online_sums.quantized_from(layer)
    layer.weight = torch.nn.Parameter(torch.zeros(128, 128, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError), online_sums._fingerprinted(_vllms_timing)(layer, layer.quant_method):
        raise RuntimeError("the quantization failed")
    assert online_sums.quantized_from(layer) is before


def test_a_layer_quantized_online_before_the_fingerprints_were_in_place_is_unverifiable_not_different():
    layer = _OnlineLinear(torch.ones(128, 128, dtype=torch.bfloat16))
    layer.quantize()  # (outside the wrapped context: an engine loaded without our plugin)
    report = held_layer_sums(_engine(layer))
    assert report["unverifiable"] == {"model.layers.0.self_attn": ONLINE_NOT_TAKEN}


def test_the_wrapper_goes_in_vllms_module_once_and_reaches_its_callers():
    from vllm.model_executor.model_loader import utils

    original = utils.online_quantization_timing_context
    try:
        online_sums.fingerprinting_online_quantization()
        wrapped = utils.online_quantization_timing_context
        online_sums.fingerprinting_online_quantization()  # (vLLM may load plugins, and so us, more than once)
        assert wrapped is utils.online_quantization_timing_context is not original
    finally:
        utils.online_quantization_timing_context = original


def test_an_fp8_checkpoints_layer_is_checked_live_in_its_quantized_form_and_a_scale_fault_is_named():
    checkpoint = _checkpoint(seed=2)
    sent: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.items():
        sent[name], sent[name + "_scale_inv"] = block_fp8(tensor)
    layer = torch.nn.Module()  # (vLLM's Fp8LinearMethod: no online quantization; e4m3 values and scales as loaded)
    layer.weight = torch.nn.Parameter(torch.cat([sent[f"{n}"] for n in checkpoint]), requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(
        torch.cat([sent[f"{n}_scale_inv"] for n in checkpoint]), requires_grad=False
    )
    held = HeldSums.combine([held_layer_sums(_engine(layer))])
    assert held.unverifiable == {} and held.differing(_sent(sent)) == []
    with torch.no_grad():
        layer.weight_scale_inv[1, 0] *= 2
    assert HeldSums.combine([held_layer_sums(_engine(layer))]).differing(_sent(sent)) == ["model.layers.0.self_attn"]


def test_vllm_quantizes_online_inside_the_context_we_wrap_and_loads_through_the_worker_wrapper():
    # (The couplings the check rests on, read from the vLLM this tier runs against: 0.32 here, 0.33 in test-vllm-next.)
    import inspect

    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.executor import multiproc_executor, uniproc_executor

    process = inspect.getsource(layerwise._layerwise_process)
    assert "import (\n            online_quantization_timing_context" in process or (
        "import online_quantization_timing_context" in process
    )
    assert "online_quantization_timing_context(layer, quant_method)" in process
    assert "self.driver_worker.load_model()" in inspect.getsource(uniproc_executor)
    assert "self.worker.load_model()" in inspect.getsource(multiproc_executor)


def test_a_layer_quantized_online_whose_key_value_heads_are_replicated_is_unverifiable_as_any_other():
    layer = _OnlineLinear(torch.ones(128, 128, dtype=torch.bfloat16))
    _quantized_online(layer)
    layer.num_kv_head_replicas = 2  # (vLLM's qkv projection with more tensor-parallel ranks than key/value heads)
    report = held_layer_sums(_engine(layer))
    assert report["unverifiable"] == {
        "model.layers.0.self_attn": "its key/value heads are copied to several tensor-parallel ranks"
    }


def test_a_moe_block_quantized_online_is_held_expert_by_expert_by_what_it_quantized_from():
    from lightning_vllm.weights.layer_sums import tensor_sums

    experts = torch.nn.Module()  # (vLLM's fused experts: a row per routed expert, one online method for the block)
    experts.global_num_experts = 4
    experts.quant_method = Fp8PerBlockOnlineLinearMethod.__new__(Fp8PerBlockOnlineLinearMethod)
    generator = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(4, 256, 128, generator=generator), torch.randn(4, 128, 128, generator=generator)
    experts.w13_weight = torch.nn.Parameter(w13.to(torch.bfloat16), requires_grad=False)
    experts.w2_weight = torch.nn.Parameter(w2.to(torch.bfloat16), requires_grad=False)
    taken = online_sums.layer_fingerprints(experts)
    assert taken["w13_weight"].shape == (4, 3)
    assert all(torch.equal(taken["w2_weight"][i], tensor_sums(experts.w2_weight[i])) for i in range(4))
    with online_sums._fingerprinted(_vllms_timing)(experts, experts.quant_method):
        experts.w13_weight = torch.nn.Parameter(block_fp8(experts.w13_weight.detach()[0])[0], requires_grad=False)
    held = HeldSums.combine([held_layer_sums(_engine(experts, "mlp", "experts"))])
    sent = _sent(
        {
            f"model.layers.0.mlp.experts.{i}.{part}.weight": tensor
            for i in range(4)
            for part, tensor in (("gate_up", w13[i].to(torch.bfloat16)), ("down", w2[i].to(torch.bfloat16)))
        }
    )
    assert held.unverifiable == {} and held.differing(sent) == []
    assert sorted(held.layers) == [f"model.layers.0.mlp.experts.{i}" for i in range(4)]
