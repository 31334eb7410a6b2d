"""What happens at a push point, once the callback has decided one is due (``callback.PushSchedule``).

A push point pushes blocking, or in the background (``background.py``): a policy every rank holds whole from rank 0
alone, under DDP the other ranks then receiving rank 0's versions; a sharded policy with the trainer's ranks in the
roles chosen at fit start (lockstep gathers, or every rank's own share: ``roles.py``). A failed push is raised or,
with ``on_sync_error="warn"``, counted and warned about. Every push's figures go to the Lightning loggers. The callback
(``callback.py``) only calls in at its hooks.
"""

from __future__ import annotations

import logging
import time
from typing import cast

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_vllm.core.push import SyncStats
from lightning_vllm.core.versions import VersionState
from lightning_vllm.core.weight_sync import WeightSync
from lightning_vllm.errors import (
    EngineConfigError,
    LandedWeightsMismatchError,
    PartialPushError,
    WeightsMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from lightning_vllm.fronts.lightning.background import BackgroundPusher
from lightning_vllm.fronts.lightning.ranks import TrainerRanks, is_sharded
from lightning_vllm.fronts.lightning.roles import LockstepGathers, choose_rank_roles
from lightning_vllm.options import PushFrom, WhenBusy

log = logging.getLogger(__name__)


class PushPoints:
    """The pushes of one ``VLLMWeightSync``: blocking or background, from one rank or all, and their outcome.

    Args:
        updater: the updater that pushes (and owns the versions).
        blocking: ``False`` sends pushes from a background thread (see ``VLLMWeightSync``).
        when_busy: with ``blocking=False``, what a push point does while a push is on its way.
        on_sync_error: ``"raise"`` or ``"warn"`` (see ``VLLMWeightSync``).
        push_from: which ranks send a sharded policy (see ``VLLMWeightSync``).
    """

    def __init__(
        self,
        updater: WeightSync,
        blocking: bool,
        when_busy: WhenBusy,
        on_sync_error: str,
        push_from: PushFrom = "rank0",
    ) -> None:
        self.updater = updater
        self.push_from: PushFrom = push_from
        self.pusher = None if blocking else BackgroundPusher(updater, when_busy)
        self.on_sync_error = on_sync_error
        self.sync_failures = 0
        self.ranks: TrainerRanks | None = None  # the trainer's ranks, when there are several
        self.roles: LockstepGathers | None = None  # how every rank takes part in a sharded push (chosen at fit start)

    def join_ranks(self, trainer: pl.Trainer, pl_module: pl.LightningModule, generate_timeout: float) -> TrainerRanks:
        """Every rank: a status group of the trainer's ranks, and whether all take part in pushes (a sharded
        policy). A collective of every rank, when fitting starts."""
        self.ranks = TrainerRanks(self.updater.options.timeout_seconds, generate_timeout)
        self.roles = choose_rank_roles(self.ranks, is_sharded(trainer.strategy.model or pl_module), self.push_from)
        if self.roles is not None and self.pusher is not None:
            rank_zero_warn(
                "VLLMWeightSync(blocking=False) pushes a sharded policy blocking: its gathers are collectives "
                "of every rank and run in the training loop's thread."
            )
        return self.ranks

    def push(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool = True) -> None:
        """Push the module's weights now (in the background if asked and possible); on every rank."""
        if trainer.sanity_checking:
            return
        try:
            self._push_now(trainer, pl_module, background and self.pusher is not None and self.roles is None)
        except WeightSyncError as error:
            self.failed(trainer, error)

    def end_of_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The engine ends on the weights of the last push point: the push in flight lands (its error, if
        any, is raised here), and a skipped push point is sent now. Every rank knows whether one was
        skipped: the count travels with the versions (:meth:`share_versions`)."""
        if self.pusher is None:
            return
        try:
            try:
                self.pusher.wait_or_raise("at the end of fitting")
            except WeightSyncTimeoutError as error:
                return self.failed(trainer, error)
            self.collect(trainer)
        finally:
            self.share_versions()
        if self.updater.versions.unsent:
            self.push(trainer, pl_module, background=False)

    def release(self) -> None:
        """End the push in flight (bounded by ``timeout_seconds``), then leave the groups."""
        if self.pusher is not None:
            self.pusher.close()
        self.updater.close()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        self.roles = None

    def _push_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool) -> None:
        if self.roles is not None:  # a sharded policy: every rank takes part
            # The strategy's model: FSDPStrategy wraps the LightningModule, whose root unit owns
            # the parameters no sub-module unit does.
            start = time.perf_counter()
            stats = self.roles.push(self.updater, trainer.strategy.model or pl_module)
            if stats is not None:
                self._log(trainer, stats, stall_seconds=time.perf_counter() - start)
            return
        # Every rank holds the full weights (DDP, or one process): rank 0 alone sends, then
        # tells the others the versions, which they need for staleness.
        try:
            if trainer.is_global_zero:
                self._push_from_rank_zero(trainer, pl_module, background)
        finally:
            self.share_versions()

    def _push_from_rank_zero(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool) -> None:
        if background:
            return self._submit(trainer, pl_module)
        start = time.perf_counter()
        if self.pusher is not None:  # a blocking push after background ones: they end first
            self.pusher.wait_or_raise("before a blocking push")
            self.collect(trainer)
        try:
            stats = self.updater.push(pl_module)
        except PartialPushError as error:
            self._log(trainer, cast(SyncStats, error.stats), stall_seconds=time.perf_counter() - start)
            raise
        log.debug("Pushed weight version %d in %.3f s", stats.weight_version, stats.seconds)
        self._log(trainer, stats, stall_seconds=time.perf_counter() - start)

    def share_versions(self) -> None:
        """Under DDP, global rank 0's versions (and skipped push points) on every rank; a collective
        of every rank at each push point. Sharded pushes share them themselves."""
        if self.ranks is None or self.roles is not None:
            return
        shared = self.ranks.broadcast_ints(self.updater.versions.state().to_ints())
        if self.ranks.rank != 0:
            with self.updater.versions.push_point() as point:
                point.adopt(VersionState.from_ints(shared))

    def _submit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.pusher is not None
        self.collect(trainer)  # a push that ended says how it went before the next one starts
        submitted = self.pusher.submit(pl_module)
        if submitted.waited_for is not None:  # when_busy="wait": the push waited for
            self._log(trainer, submitted.waited_for)
        metrics = {"vllm/sync_stall_seconds": submitted.stall_seconds}
        if not submitted.started:
            metrics["vllm/sync_skipped"] = float(self.updater.versions.skipped)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def collect(self, trainer: pl.Trainer) -> None:
        """Log the background push that landed since the last look, or handle its error."""
        if self.pusher is None:
            return
        try:
            stats = self.pusher.collect()
        except PartialPushError as error:
            self._log(trainer, cast(SyncStats, error.stats))
            return self.failed(trainer, error)
        except WeightSyncError as error:
            return self.failed(trainer, error)
        if stats is not None:
            self._log(trainer, stats)

    def failed(self, trainer: pl.Trainer, error: WeightSyncError) -> None:
        # (The updater has counted the push point as missed, unless some engine took it.)
        misfit = isinstance(error, (EngineConfigError, WeightsMismatchError))
        if self.on_sync_error == "raise" or (misfit and not isinstance(error, LandedWeightsMismatchError)):
            raise error  # (a misconfigured engine or weights that do not fit: a retry would fail the same way)
        self.sync_failures += 1
        rank_zero_warn(
            f"Pushing weights to vLLM failed ({error}). Training goes on (on_sync_error='warn'); the engine keeps "
            f"its last weights and the next push point tries again. Failed pushes so far: {self.sync_failures}."
        )
        for logger in trainer.loggers:
            logger.log_metrics({"vllm/sync_failures": float(self.sync_failures)}, step=trainer.global_step)

    def _log(self, trainer: pl.Trainer, stats: SyncStats, stall_seconds: float | None = None) -> None:
        metrics = {
            "vllm/weight_version": float(stats.weight_version),
            "vllm/sync_seconds": stats.seconds,
            "vllm/sync_bytes": float(stats.num_bytes),
            # A slow link (low GB/s over the transfer) tells itself from a slow engine (a long commit or pause).
            "vllm/sync_gb_per_second": stats.gb_per_second,
            "vllm/sync_transfer_seconds": stats.timing.transfer_seconds,
            "vllm/sync_commit_seconds": stats.timing.commit_seconds,
            "vllm/sync_pause_seconds": stats.timing.pause_seconds,
            "vllm/sync_check_seconds": stats.timing.check_seconds,
        }
        if stall_seconds is not None:  # a background push's stall was logged at its push point
            metrics["vllm/sync_stall_seconds"] = stall_seconds
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
