"""The grouped CPU LoRA ops give vLLM's own ops' numbers, and are installed only when asked for."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops import torch_ops
from vllm.lora.punica_wrapper import punica_cpu

from lightning_vllm.in_vllm.lora_ops import (
    CPU_LORA_OPS_VARIABLE,
    cpu_lora_ops_requested,
    grouped_ops,
    install_grouped_cpu_lora_ops,
)
from lightning_vllm.in_vllm.plugin import register_backends

GROUPED = grouped_ops(torch_ops)
ROWS, RANK, IN, OUT, SLOTS = 11, 4, 24, 40, 3


def slot_cases() -> list[torch.Tensor]:
    return [
        torch.full((ROWS,), 1),  # one adapter: what a pushed policy's rollouts use
        torch.tensor([0, 2, 2, 1, 0, 1, 2, 2, 0, 1, 1]),  # several
        torch.tensor([-1, 0, -1, 1, 1, 0, -1, 2, 2, 0, -1]),  # negative slots count from the end, as vLLM's gather
    ]


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request) -> torch.dtype:
    return request.param


def outputs_of(name: str, ops: dict | object, *args) -> torch.Tensor:
    output, rest = args[2].clone(), args[3:]
    (ops[name] if isinstance(ops, dict) else getattr(ops, name))(args[0], args[1], output, *rest)
    return output


@pytest.mark.parametrize("slots", slot_cases())
@pytest.mark.parametrize("stacked_dims", [3, 4])
def test_bgmv_ops_match_vllms(slots, stacked_dims, dtype):
    torch.manual_seed(0)
    inputs = torch.randn(ROWS, IN, dtype=dtype)
    lora_a = torch.randn(SLOTS, 1, RANK, IN, dtype=dtype)
    lora_b = torch.randn(SLOTS, 1, OUT, RANK, dtype=dtype)
    if stacked_dims == 3:
        lora_a, lora_b = lora_a.squeeze(1), lora_b.squeeze(1)
    shrunk = torch.randn(ROWS, RANK, dtype=torch.float32)
    base = torch.randn(ROWS, OUT + 6, dtype=dtype)  # the model's output may be padded past the adapter's
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    cases = [
        ("bgmv_shrink", inputs, lora_a, torch.zeros(ROWS, RANK), slots, 0.5),
        ("bgmv_expand", shrunk, lora_b, base, slots, True),
        ("bgmv_expand", shrunk, lora_b, base, slots, False),
        ("bgmv_expand_slice", shrunk, lora_b, base, slots, 3, OUT, True),
        ("bgmv_expand_slice", shrunk, lora_b, base, slots, 2, OUT, False),
    ]
    for name, *args in cases:
        torch.testing.assert_close(outputs_of(name, GROUPED, *args), outputs_of(name, torch_ops, *args), **tolerance)


def test_sgmv_ops_match_vllms_over_sequences_of_several_adapters():
    torch.manual_seed(1)
    seq_lens = torch.tensor([3, 5, 3])
    adapters = torch.tensor([2, -1, 0])
    meta = (torch.tensor([0, 3, 8]), seq_lens, adapters, 3, 5, ROWS)
    inputs = torch.randn(ROWS, IN)
    lora_a, lora_b = torch.randn(SLOTS, 1, RANK, IN), torch.randn(SLOTS, 1, OUT, RANK)
    shrunk, base = torch.randn(ROWS, RANK), torch.randn(ROWS, OUT)
    cases = [
        ("sgmv_shrink", inputs, lora_a, torch.zeros(ROWS, RANK), *meta, 2.0),
        ("sgmv_expand", shrunk, lora_b, base, *meta, True),
        ("sgmv_expand_slice", shrunk, lora_b, torch.randn(ROWS, OUT + 8), *meta, 8, OUT, True),
    ]
    for name, *args in cases:
        torch.testing.assert_close(outputs_of(name, GROUPED, *args), outputs_of(name, torch_ops, *args))


def test_a_shape_the_ops_were_not_written_for_goes_to_vllms_op():
    inputs, slots = torch.randn(1, IN), torch.zeros(ROWS, dtype=torch.long)  # vLLM's op broadcasts one row
    lora_b = torch.randn(SLOTS, 1, OUT, IN)
    args = (inputs, lora_b, torch.zeros(ROWS, OUT), slots, True)
    torch.testing.assert_close(outputs_of("bgmv_expand", GROUPED, *args), outputs_of("bgmv_expand", torch_ops, *args))


def test_installed_by_the_plugin_only_when_the_variable_asks(monkeypatch):
    for name in GROUPED:
        monkeypatch.setattr(punica_cpu, name, getattr(torch_ops, name))  # restored after the test
    monkeypatch.delenv(CPU_LORA_OPS_VARIABLE, raising=False)
    register_backends()
    assert not cpu_lora_ops_requested() and punica_cpu.bgmv_shrink is torch_ops.bgmv_shrink

    monkeypatch.setenv(CPU_LORA_OPS_VARIABLE, "grouped")
    register_backends()
    assert all(getattr(punica_cpu, name) is not getattr(torch_ops, name) for name in GROUPED)
    assert install_grouped_cpu_lora_ops()  # again: still installed, nothing else changes


def test_an_unknown_value_names_the_only_one(monkeypatch):
    monkeypatch.setenv(CPU_LORA_OPS_VARIABLE, "fast")
    with pytest.raises(ValueError, match=r"LIGHTNING_VLLM_CPU_LORA_OPS='fast'.*'grouped'"):
        install_grouped_cpu_lora_ops()
