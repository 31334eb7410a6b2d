"""The callback's ``sleep_level``: vLLM asleep while the trainer steps, its weights woken for a push, all of it for
rollouts (the order verl's hybrid engine, OpenRLHF and TRL's colocate mode follow).

Per optimizer step, on the rank that holds the engines::

    training_step: generate -> the engine wakes (its weights, if asleep, and its KV cache)  (rollouts.py)
    backward                -> the engine sleeps at sleep_level                  (SleepBetweenSteps.before_backward)
    push point              -> the weights wake, the push lands, the KV cache sleeps on      (core/connection.py)

The engine-side rules (what a push or a rollout finds, and does) are ``engines/sleep.py``'s; this module only says
when. Level 2 drops the weights: a step with no push due leaves nothing to sample from, so its rollouts push first
(:meth:`SleepBetweenSteps.pushes_first`).
"""

from __future__ import annotations

import logging
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_vllm.core.weight_sync import WeightSync
from lightning_vllm.engines.local import InProcessEngine
from lightning_vllm.engines.sleep import (
    WeightsDroppedError,
    host_copy_problem,
    require_sleep_mode,
    sleep_engines,
    sleeping_engine,
    wake_for_rollouts,
)
from lightning_vllm.fronts.lightning.background import BackgroundPusher
from lightning_vllm.options import SleepLevel
from lightning_vllm.weights.model import metadata_bytes

log = logging.getLogger(__name__)


class SleepBetweenSteps:
    """When the engines of ``updater`` sleep: before every backward, at its options' ``sleep_level`` (``None``: never).

    A background push (``blocking=False``) overlaps the next step's forward and rollouts, never a sleep: the engine
    sleeps once it landed.

    Args:
        updater: the core whose engines sleep (none on ranks that hold no engine: nothing to do there).
        pusher: the callback's background pusher, if it pushes in the background.
    """

    def __init__(self, updater: WeightSync, pusher: BackgroundPusher | None = None) -> None:
        self.updater = updater
        self.pusher = pusher

    @property
    def level(self) -> SleepLevel | None:
        """The level engines sleep at (the options' ``sleep_level``, stored there only)."""
        return self.updater.options.sleep_level

    def check(self) -> None:
        """At fit start, before any byte moves: refuse engines that cannot sleep; warn when level 1's host copy of an
        in-process engine's weights cannot fit in host memory.

        Raises:
            EngineConfigError: an engine was built without ``enable_sleep_mode=True`` (vLLM's CPU build has none),
                or cannot sleep at all; the message says which and the fix.
        """
        engines = self.updater.engines
        if self.level is None or not engines:
            return
        require_sleep_mode(engines)
        if self.level != 1:
            return
        for engine in engines:
            expected = engine.expected_weights() if isinstance(engine, InProcessEngine) else None
            if expected is not None and (
                problem := host_copy_problem(metadata_bytes(expected.weights), engine.description)
            ):
                rank_zero_warn(problem)

    def before_backward(self, trainer: pl.Trainer) -> None:
        """Put every engine to sleep: the backward and the optimizer step get its GPU memory. Logs
        ``vllm/sleep_seconds`` and, on a GPU, ``vllm/gpu_free_gib`` once the engines sleep."""
        if self.level is None or not self.updater.engines:
            return
        if self.pusher is not None:
            self.pusher.wait_or_raise("when the engine was to sleep before backward")
        options = self.updater.options
        started = time.perf_counter()
        sleep_engines(self.updater.engines, self.level, options.pause_mode, options.timeout_seconds)
        metrics = {"vllm/sleep_seconds": time.perf_counter() - started}
        if torch.cuda.is_available():
            metrics["vllm/gpu_free_gib"] = torch.cuda.mem_get_info()[0] / 2**30
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def pushes_first(self, error: WeightsDroppedError, world_size: int) -> bool:
        """Whether rollouts that met dropped weights (``error``) push the trainer's weights first: with
        ``sleep_level=2`` in a single trainer process, unless a background push on its way refills them (it is waited
        for instead). Under DDP one rank generates for all, and a push takes every rank: the rollouts are refused
        instead, with the fix.

        Raises:
            WeightsDroppedError: the rollouts cannot push first (``error``, or a DDP run's own).
            WeightSyncTimeoutError: the background push on its way did not land in ``timeout_seconds``.
        """
        if self.pusher is not None and self.pusher.in_flight():
            self.pusher.wait_or_raise("when rollouts met dropped weights")
            return False
        if self.level != 2:
            raise error
        if world_size > 1:
            raise WeightsDroppedError(
                f"{error} With sleep_level=2 under several trainer ranks, push at every step "
                "(every_n_train_steps=1), or pass sleep_level=1."
            ) from error
        log.info("The engine's weights were dropped since the last push (sleep_level=2): pushing before rollouts.")
        return True

    def wake_after_fit(self) -> None:
        """At the end of fitting: every engine awake, to be used as the user likes (one whose weights were dropped
        since the last push is left asleep, said once)."""
        if self.level is None:
            return
        for engine in self.updater.engines:
            if (sleeps := sleeping_engine(engine)) is None:
                continue
            try:
                wake_for_rollouts(sleeps, self.updater.options.timeout_seconds)  # (every call bounded)
            except WeightsDroppedError:
                rank_zero_warn(
                    f"{engine.description} stays asleep after fit: its weights were dropped since the last push."
                )
