"""Rollouts from inside ``training_step``: sample from the engine the callback keeps in sync."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from lightning_vllm.callback import VLLMWeightSync
from lightning_vllm.engines import Generation


def weight_sync_of(module: pl.LightningModule) -> VLLMWeightSync:
    """The ``VLLMWeightSync`` callback of the trainer running ``module``.

    Raises:
        RuntimeError: the module is not attached to a trainer, or the trainer has no
            such callback, or several.
    """
    if module._trainer is None:
        raise RuntimeError(f"{type(module).__name__} is not attached to a Trainer: generate inside training_step.")
    trainer = module.trainer
    # Lightning sets Trainer.callbacks per instance, so type checkers do not see it.
    callbacks = [callback for callback in getattr(trainer, "callbacks", []) if isinstance(callback, VLLMWeightSync)]
    if len(callbacks) != 1:
        raise RuntimeError(
            f"The Trainer has {len(callbacks)} VLLMWeightSync callbacks; rollouts need exactly one "
            "(Trainer(callbacks=[VLLMWeightSync(engine=...)]))."
        )
    return callbacks[0]


def generate(
    module: pl.LightningModule,
    prompts: Sequence[list[int] | str],
    sampling_params: Any = None,
    *,
    worker_id: int = 0,
) -> list[Generation]:
    """Sample rollouts from inside ``training_step`` with the engine the callback keeps in sync.

    Args:
        module: the LightningModule (``self`` in ``training_step``).
        prompts: token-id lists, or texts when the engine has a tokenizer.
        sampling_params: vLLM ``SamplingParams``.
        worker_id: which engine, when the callback updates several.

    Returns:
        One :class:`Generation` per sample: token ids, logprobs, text, weight version.

    Example::

        >>> from vllm import SamplingParams  # doctest: +SKIP
        >>> def training_step(self, batch, batch_idx):  # doctest: +SKIP
        ...     rollouts = generate(self, batch["prompt_ids"], SamplingParams(n=8, logprobs=0))
    """
    return weight_sync_of(module).generate(prompts, sampling_params, worker_id=worker_id)
