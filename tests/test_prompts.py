"""Prompts are checked before any reaches vLLM: accepted forms, and a clear error for everything else."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_vllm.prompts import PromptLimits, checked_prompts

LIMITS = PromptLimits(vocab_size=512, max_model_len=16, accepts_text=True)
TOKEN_PROMPTS = [[1, 5, 9, 33], [100, 200, 300, 400]]


def default_collated_batch():
    """What PyTorch's default collate makes of two token-id lists: one tensor per position."""
    return next(iter(DataLoader(TOKEN_PROMPTS, batch_size=2)))


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        (TOKEN_PROMPTS, TOKEN_PROMPTS),
        ([(1, 2), [np.int64(3)]], [[1, 2], [3]]),
        ([np.array([4, 5])], [[4, 5]]),
        (["a text", "another"], ["a text", "another"]),
        (torch.tensor(TOKEN_PROMPTS), TOKEN_PROMPTS),
        ([], []),
        (next(iter(DataLoader(TOKEN_PROMPTS, batch_size=2, collate_fn=list))), TOKEN_PROMPTS),
    ],
)
def test_accepted_forms(prompts, expected):
    assert checked_prompts(prompts, LIMITS) == expected


def test_padding_is_stripped_from_both_ends_of_tensor_rows_when_named():
    batch = torch.tensor([[0, 0, 7, 8], [9, 10, 0, 0], [0, 11, 0, 12]])
    assert checked_prompts(batch, LIMITS, pad_token_id=0) == [[7, 8], [9, 10], [11, 0, 12]]
    assert checked_prompts(batch, LIMITS) == batch.tolist()  # no pad id: rows are used whole
    with pytest.raises(ValueError, match="Prompt 0 is empty"):
        checked_prompts(torch.zeros(1, 3, dtype=torch.long), LIMITS, pad_token_id=0)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (default_collated_batch(), r"list of tensors.*transposed.*collate_fn=list"),
        (torch.tensor(TOKEN_PROMPTS, dtype=torch.float32), r"torch.float32 tensor; token ids are integers"),
        ([[1.0, 2.0]], r"Prompt 0 holds 1.0 \(float\); token ids are integers"),
        ([[[1, 2], [3]]], r"Prompt 0 is nested"),
        ([[True, 1]], r"Prompt 0 holds True \(bool\)"),
        ([["1", 2]], r"Prompt 0 holds '1' \(str\)"),
        (torch.tensor([1, 2, 3]), r"1-D tensor.*prompts.unsqueeze\(0\)"),
        ("one text", r"single str; wrap it in a list"),
        ({"input_ids": torch.tensor([[1]])}, r"'input_ids' tensor with pad_token_id"),
        (42, r"prompts is a int"),
        ([{1, 2}], r"Prompt 0 is a set"),
    ],
)
def test_forms_that_are_refused_name_what_is_accepted(prompts, message):
    with pytest.raises(TypeError, match=message) as caught:
        checked_prompts(prompts, LIMITS)
    assert "list of token-id lists" in str(caught.value)


@pytest.mark.parametrize(
    ("prompts", "limits", "message"),
    [
        ([[1, 512]], LIMITS, r"Prompt 0 holds token id 512, outside the engine's vocabulary \[0, 512\)"),
        ([[3], [-1]], LIMITS, r"Prompt 1 holds token id -1"),
        ([list(range(16))], LIMITS, r"Prompt 0 has 16 tokens; the engine's max_model_len=16.*at most 15 tokens"),
        ([[]], LIMITS, r"Prompt 0 is empty"),
        (["text"], PromptLimits(accepts_text=False), r"Prompt 0 is text but the engine has no tokenizer"),
    ],
)
def test_values_the_engine_cannot_take_are_refused(prompts, limits, message):
    with pytest.raises(ValueError, match=message):
        checked_prompts(prompts, limits)


def test_unknown_limits_are_not_checked():
    assert checked_prompts([[10_000] * 40], PromptLimits()) == [[10_000] * 40]
