"""What is asked of vLLM: prompts checked before any of them reaches an engine.

vLLM trusts what it is given: a batch that PyTorch's default collate turned into a
list of tensors makes its engine core fail to decode the request (and
``LLM.generate`` then waits forever), and a token id outside the vocabulary kills
the engine core. Every prompt is therefore checked here, against the engine's
limits, and refused with an error that names the accepted forms and the fix.

Accepted forms:

* a list of token-id lists (``[[1, 5, 9], [4, 2]]``; tuples and NumPy integers too);
* a list of strings, when the engine has a tokenizer;
* a 2-D integer tensor, one row per prompt. Rows are used whole, unless
  ``pad_token_id`` is given: then runs of it at both ends of a row are removed,
  so left- and right-padded batches both work.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Prompt = list[int] | str

ACCEPTED_FORMS = (
    "Pass a list of token-id lists (e.g. [[1, 5, 9], [4, 2]]), a list of strings when the engine has a "
    "tokenizer, or a 2-D integer tensor with one row per prompt (pad_token_id=... strips padding)."
)
COLLATE_HINT = (
    "A DataLoader's default collate turns a batch of token-id lists into a list of tensors, one per "
    "position across the prompts (transposed): build the DataLoader with collate_fn=list."
)


@dataclass(frozen=True)
class PromptLimits:
    """What an engine accepts: ``None`` where the engine does not say.

    Attributes:
        vocab_size: token ids must be in ``[0, vocab_size)``.
        max_model_len: a prompt must be shorter than this (vLLM needs room for one token).
        accepts_text: whether the engine has a tokenizer (``skip_tokenizer_init`` off).
    """

    vocab_size: int | None = None
    max_model_len: int | None = None
    accepts_text: bool = True


def checked_prompts(prompts: Any, limits: PromptLimits, *, pad_token_id: int | None = None) -> list[Prompt]:
    """The prompts as vLLM takes them, after checking every one against ``limits``.

    Args:
        prompts: token-id lists, strings, or a 2-D integer tensor (see the module docstring).
        limits: the engine's vocabulary size, maximum model length and tokenizer.
        pad_token_id: for a tensor, the padding id to strip from both ends of each row.

    Raises:
        TypeError: a form that is not accepted (floats, nested lists, a list of tensors, ...).
        ValueError: an empty prompt, a token id outside the vocabulary, a prompt too long
            for the engine, or text for an engine without a tokenizer.

    Example::

        >>> checked_prompts(torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]]), PromptLimits(vocab_size=16), pad_token_id=0)
        [[5, 6], [7, 8, 9]]
        >>> checked_prompts([[1, 2], [3, 99]], PromptLimits(vocab_size=16))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Prompt 1 holds token id 99, outside the engine's vocabulary [0, 16). ...
    """
    rows = _tensor_rows(prompts, pad_token_id) if isinstance(prompts, torch.Tensor) else _listed(prompts)
    for index, prompt in enumerate(rows):
        _check_limits(index, prompt, limits)
    return rows


def _listed(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts is a single {type(prompts).__name__}; wrap it in a list: [prompt]. {ACCEPTED_FORMS}")
    if isinstance(prompts, Mapping):
        raise TypeError(
            f"prompts is a {type(prompts).__name__} (a tokenizer's output?): pass its 'input_ids' tensor with "
            f"pad_token_id=tokenizer.pad_token_id. {ACCEPTED_FORMS}"
        )
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts is a {type(prompts).__name__}. {ACCEPTED_FORMS}")
    if any(isinstance(prompt, torch.Tensor) for prompt in prompts):
        raise TypeError(
            f"prompts is a list of tensors, which cannot be told apart from transposed prompts. {COLLATE_HINT} "
            f"{ACCEPTED_FORMS}"
        )
    return [_one(index, prompt) for index, prompt in enumerate(prompts)]


def _one(index: int, prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # a NumPy row
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"Prompt {index} is a {type(prompt).__name__}. {ACCEPTED_FORMS}")
    for token in prompt:
        if not isinstance(token, str) and hasattr(token, "__len__"):  # a list, a tuple, a tensor, ...
            raise TypeError(f"Prompt {index} is nested: a prompt is one flat list of token ids. {ACCEPTED_FORMS}")
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(
                f"Prompt {index} holds {token!r} ({type(token).__name__}); token ids are integers. {ACCEPTED_FORMS}"
            )
    return [int(token) for token in prompt]


def _tensor_rows(prompts: torch.Tensor, pad_token_id: int | None) -> list[Prompt]:
    if prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool:
        raise TypeError(f"prompts is a {prompts.dtype} tensor; token ids are integers. {ACCEPTED_FORMS}")
    if prompts.dim() != 2:
        raise TypeError(
            f"prompts is a {prompts.dim()}-D tensor; a tensor must be 2-D, one row per prompt "
            f"(one prompt: prompts.unsqueeze(0)). {ACCEPTED_FORMS}"
        )
    rows: list[Prompt] = []
    for row in prompts.tolist():
        if pad_token_id is not None:
            start, stop = 0, len(row)
            while start < stop and row[start] == pad_token_id:
                start += 1
            while stop > start and row[stop - 1] == pad_token_id:
                stop -= 1
            row = row[start:stop]
        rows.append(row)
    return rows


def _check_limits(index: int, prompt: Prompt, limits: PromptLimits) -> None:
    if isinstance(prompt, str):
        if not limits.accepts_text:
            raise ValueError(
                f"Prompt {index} is text but the engine has no tokenizer (started with skip_tokenizer_init=True): "
                "pass token ids, or start the engine with its tokenizer."
            )
        return
    if not prompt:
        raise ValueError(f"Prompt {index} is empty; vLLM needs at least one token (after padding is stripped).")
    if limits.vocab_size is not None:
        outside = [token for token in prompt if not 0 <= token < limits.vocab_size]
        if outside:
            raise ValueError(
                f"Prompt {index} holds token id {outside[0]}, outside the engine's vocabulary "
                f"[0, {limits.vocab_size}). Tokenize with the tokenizer of the model the engine serves, and "
                "strip padding ids that are not tokens."
            )
    if limits.max_model_len is not None and len(prompt) >= limits.max_model_len:
        raise ValueError(
            f"Prompt {index} has {len(prompt)} tokens; the engine's max_model_len={limits.max_model_len} leaves no "
            f"room to generate. Shorten it to at most {limits.max_model_len - 1} tokens or start the engine with a "
            "larger max_model_len."
        )
