"""Rollouts from inside ``training_step``: sampling from the engines kept in sync, and staleness.

Each sample carries the weight version that produced it. A :class:`RolloutSampler`
remembers the oldest version sampled since the trainer last asked, so the callback
can log ``vllm/staleness`` and refuse rollouts older than ``max_staleness``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lightning_vllm.engines import Generation
from lightning_vllm.errors import StaleRolloutsError

if TYPE_CHECKING:
    from lightning_vllm.updater import VLLMUpdater


def version_number(weight_version: str | None) -> int:
    """A weight version string as a number; vLLM's ``"default"`` (never pushed) is 0.

    Example::

        >>> version_number("7"), version_number("default"), version_number(None)
        (7, 0, 0)
    """
    return int(weight_version) if weight_version is not None and weight_version.isdigit() else 0


class RolloutSampler:
    """Samples from an updater's engines and keeps track of how stale the samples are.

    Args:
        updater: the updater whose engines are sampled and whose version is the trainer's.
        max_staleness: the most versions a sample may lag the trainer; ``None`` for no limit.
    """

    def __init__(self, updater: VLLMUpdater, max_staleness: int | None = None) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"Invalid value for max_staleness={max_staleness}. Must be >= 0, or None.")
        self.updater = updater
        self.max_staleness = max_staleness
        self._oldest_version: int | None = None

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any = None, *, worker_id: int = 0
    ) -> list[Generation]:
        """Sample from engine ``worker_id``; one entry per sample, each with its weight version.

        Raises:
            RuntimeError: this rank holds no engine.
            StaleRolloutsError: a sample is more than ``max_staleness`` versions behind.
        """
        engines = self.updater.engines
        if not engines:
            raise RuntimeError(
                "This rank holds no vLLM engine to generate from (under DDP only global rank 0 has one unless every "
                "rank is given an engine, e.g. a server URL)."
            )
        if sampling_params is None:
            from vllm import SamplingParams

            sampling_params = SamplingParams()
        generations = engines[worker_id].generate(prompts, sampling_params)
        self.record([generation.weight_version for generation in generations])
        return generations

    def record(self, weight_versions: Sequence[str | None]) -> None:
        """Note the versions of samples about to be used; refuse them if too stale.

        Raises:
            StaleRolloutsError: one is more than ``max_staleness`` versions behind the trainer.
        """
        if not weight_versions:
            return
        oldest = min(version_number(version) for version in weight_versions)
        current = self.updater.weight_version
        if self.max_staleness is not None and current - oldest > self.max_staleness:
            raise StaleRolloutsError(
                f"Rollouts from weight version {oldest} are {current - oldest} versions behind the trainer "
                f"(version {current}), more than max_staleness={self.max_staleness}. Push more often "
                "(every_n_train_steps), generate from the engines this callback updates, or raise max_staleness."
            )
        if self._oldest_version is None or oldest < self._oldest_version:
            self._oldest_version = oldest

    def take_staleness(self) -> int | None:
        """The trainer's version minus the oldest version sampled since the last call (``None``: no samples)."""
        if self._oldest_version is None:
            return None
        staleness = self.updater.weight_version - self._oldest_version
        self._oldest_version = None
        return staleness


def sampler_of(module: pl.LightningModule) -> RolloutSampler:
    """The rollout sampler of the ``VLLMWeightSync`` callback of the trainer running ``module``.

    Raises:
        RuntimeError: the module is not attached to a trainer, or the trainer has no
            such callback, or several.
    """
    if module._trainer is None:
        raise RuntimeError(f"{type(module).__name__} is not attached to a Trainer: generate inside training_step.")
    # Lightning sets Trainer.callbacks per instance, so type checkers do not see it.
    callbacks = getattr(module.trainer, "callbacks", [])
    samplers = [
        callback.rollouts for callback in callbacks if isinstance(getattr(callback, "rollouts", None), RolloutSampler)
    ]
    if len(samplers) != 1:
        raise RuntimeError(
            f"The Trainer has {len(samplers)} VLLMWeightSync callbacks; rollouts need exactly one "
            "(Trainer(callbacks=[VLLMWeightSync(engine=...)]))."
        )
    return samplers[0]


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
    return sampler_of(module).generate(prompts, sampling_params, worker_id=worker_id)
