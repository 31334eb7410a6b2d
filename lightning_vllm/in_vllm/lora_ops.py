"""vLLM's CPU LoRA kernels, one matrix product per adapter instead of one per token: a setting the plugin applies.

vLLM's CPU build applies LoRA adapters with the PyTorch ops of ``vllm/lora/ops/torch_ops``
(used by ``PunicaWrapperCPU``). For every token of a batch they gather a private copy of its
adapter's matrices (``lora_b_weights[lora_indices_tensor]``) and multiply with a batched
``einsum``. Every LoRA layer of the model goes through them, for every token, so an engine built
with ``enable_lora=True`` generated 2.5 times slower than without it on 2 CPU cores, and 8 times
slower with an adapter in use (SmolLM2-135M, 64 answers of 16 tokens: 43 s against 5.6 s); a
profile put 80 % of the time in that gather, its copy and the batched product.

A batch holds few distinct adapters (one, for a policy pushed with ``lora="adapter"``), so the same
numbers come from one matrix product per adapter slot over the rows that use it. When
``LIGHTNING_VLLM_CPU_LORA_OPS=grouped`` is set, the package's vLLM plugin (loaded in every vLLM
process) installs such ops in ``PunicaWrapperCPU``'s module. They keep vLLM's signatures and
hand any call they were not written for back to vLLM's own ops. They also keep the installed
vLLM's meaning of slot -1 (no adapter), which changed between releases: 0.32's gather reads it as
the last slot, 0.33 adds nothing for it and leaves the row as it was. Which one holds is asked of
vLLM's own op once, on a 1 x 1 example. Without the variable nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

CPU_LORA_OPS_VARIABLE = "LIGHTNING_VLLM_CPU_LORA_OPS"
GROUPED = "grouped"


def cpu_lora_ops_requested() -> bool:
    """Whether ``LIGHTNING_VLLM_CPU_LORA_OPS`` asks for the grouped ops.

    Raises:
        ValueError: the variable holds something other than ``grouped`` (or nothing).
    """
    value = os.environ.get(CPU_LORA_OPS_VARIABLE, "").strip()
    if value not in ("", GROUPED):
        raise ValueError(f"{CPU_LORA_OPS_VARIABLE}={value!r}: the only value is {GROUPED!r} (unset: vLLM's own ops).")
    return value == GROUPED


def grouped_lora_product(
    inputs: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, skips_no_lora: bool
) -> torch.Tensor:
    """``einsum("bi,boi->bo", inputs, weights[slots])`` without copying a matrix per row.

    Args:
        inputs: ``(rows, in)``.
        weights: ``(num_slots, out, in)`` or ``(num_slots, 1, out, in)``, vLLM's stacked adapters.
        slots: ``(rows,)`` the adapter slot of each row.
        dtype: the dtype of the product (the output tensor's, as in vLLM's ops).
        skips_no_lora: rows of slot -1 have no adapter and get zeros (vLLM 0.33); otherwise a
            negative slot counts from the end, as indexing does (vLLM 0.32).
    """
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    distinct = torch.unique(slots).tolist()
    if len(distinct) == 1 and not (skips_no_lora and distinct[0] == -1):
        return inputs @ weights[distinct[0]].to(dtype).T
    outputs = inputs.new_zeros((inputs.shape[0], weights.shape[1]))
    for slot in distinct:
        if skips_no_lora and slot == -1:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        outputs[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return outputs


def skips_no_lora(stock: ModuleType) -> bool:
    """Whether the installed vLLM's ops add nothing for slot -1 (0.33) instead of reading the last slot (0.32)."""
    output = torch.zeros(1, 1)
    stock.bgmv_shrink(torch.ones(1, 1), torch.ones(1, 1, 1), output, torch.tensor([-1]), 1.0)
    return output.item() == 0.0


def _fits(inputs: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> bool:
    """The shapes these ops were written for; anything else goes to vLLM's own op."""
    squeezable = weights.dim() == 3 or (weights.dim() == 4 and weights.shape[1] == 1)
    return inputs.dim() == 2 and slots.dim() == 1 and squeezable and inputs.shape[0] == slots.shape[0]


def grouped_ops(stock: ModuleType) -> dict[str, Callable[..., Any]]:
    """The six ops of ``vllm.lora.ops.torch_ops``, grouped by adapter slot; ``stock`` is that module."""
    skips = skips_no_lora(stock)

    def product(inputs: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return grouped_lora_product(inputs, weights, slots, dtype, skips)

    def kept(slots: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """A row without adapter keeps what it held where vLLM's op leaves it untouched (0.33)."""
        return torch.where((slots == -1).unsqueeze(-1), old, new) if skips else new

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if not _fits(inputs, lora_a_weights, lora_indices_tensor):
            return stock.bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        outputs = product(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        if not _fits(inputs, lora_b_weights, lora_indices_tensor):
            return stock.bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        outputs = product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        limit = 1 if outputs.shape[0] == 1 else output_tensor.shape[0]  # as vLLM's op does
        common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            old = output_tensor[:, :common]
            output_tensor[:, :common] = kept(lora_indices_tensor[:limit], old, outputs[:limit, :common])

    def bgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True
    ):
        if not _fits(inputs, lora_b_weights, lora_indices_tensor):
            return stock.bgmv_expand_slice(
                inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
            )
        outputs = product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
        else:
            old = output_tensor[:, slice_offset : slice_offset + slice_size]
            output_tensor[:, slice_offset : slice_offset + slice_size] = kept(lora_indices_tensor, old, outputs)

    def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, scaling):  # fmt: skip
        slots = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
        bgmv_shrink(inputs, lora_a_weights, output_tensor, slots, scaling)

    def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, add_inputs=False):  # fmt: skip
        slots = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
        bgmv_expand(inputs, lora_b_weights, output_tensor, slots, add_inputs)

    def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                          batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):  # fmt: skip
        slots = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
        bgmv_expand_slice(inputs, lora_b_weights, output_tensor, slots, slice_offset, slice_size, add_inputs)

    ops = (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink, sgmv_expand, sgmv_expand_slice)
    return {op.__name__: op for op in ops}


def install_grouped_cpu_lora_ops() -> bool:
    """Install the grouped ops in ``PunicaWrapperCPU``'s module when the variable asks; returns whether
    they are installed. Safe to call more than once (vLLM may load plugins repeatedly)."""
    if not cpu_lora_ops_requested():
        return False
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name, op in grouped_ops(torch_ops).items():
        setattr(punica_cpu, name, op)
    return True
