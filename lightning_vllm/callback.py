"""When to send: a Lightning callback that keeps a vLLM engine on the trainer's weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Literal, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_vllm.background import BackgroundPusher
from lightning_vllm.engines import Generation
from lightning_vllm.engines.local import build_local_engine
from lightning_vllm.errors import (
    EngineConfigError,
    PartialPushError,
    WeightsMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from lightning_vllm.options import LoraMode, PauseMode, SyncOptions, UpdaterOptions, WhenBusy, check_options
from lightning_vllm.ranks import TrainerRanks, is_sharded, push_from_every_rank
from lightning_vllm.rollouts import RolloutSampler
from lightning_vllm.schedule import PushSchedule
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_GENERATE_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS
from lightning_vllm.updater import SyncStats, VLLMUpdater

log = logging.getLogger(__name__)


class VLLMWeightSync(Callback):
    """Push the LightningModule's Hugging Face weights into vLLM while training.

    Pushes once when fitting starts (so vLLM starts from the trainer's weights),
    then every ``every_n_train_steps`` optimizer steps and/or every
    ``every_n_epochs`` epochs. Each push logs ``vllm/weight_version``,
    ``vllm/sync_seconds`` and ``vllm/sync_bytes`` to every Lightning logger. Only
    global rank 0 talks to vLLM. Under DDP the other ranks skip the push and then receive
    rank 0's versions (so they wait for a blocking push); a sharded policy is gathered by
    every rank for every push (``docs/strategies.md``).

    Rollouts: inside ``training_step``, :meth:`generate` (or
    ``lightning_vllm.generate(self, prompts)``) samples from the engine this callback
    keeps in sync; each sample carries the weight version that produced it. The
    callback logs ``vllm/staleness`` (trainer version minus the oldest rollout version
    used in the step) and raises ``StaleRolloutsError`` beyond ``max_staleness``.

    Args:
        engine: the vLLM engine(s) to update: a ``vllm.LLM`` built with
            ``weight_transfer_config={"backend": "gloo"}``, an ``AsyncLLM``, a server URL,
            a Ray actor handle, a list of them, or a dict of ``vllm.LLM`` arguments (the
            engine is then built on global rank 0 when fitting starts, which also makes the
            callback configurable from a LightningCLI YAML file). ``None`` on ranks that
            hold no engine (under DDP, only global rank 0 needs one).
        every_n_train_steps: push after every N optimizer steps; ``None`` or 0 turns it off.
        every_n_epochs: push at the end of every N training epochs; ``None`` or 0 turns it off.
        push_on_fit_start: push once before the first training step.
        model_attribute: LightningModule attribute holding the Hugging Face model;
            found automatically when ``None``.
        backend: ``"auto"``, ``"gloo"``, ``"nccl"`` or ``"ipc"`` (see ``VLLMUpdater``).
        master_address: address the trainer listens on for the rendezvous (loopback by default).
        master_port: rendezvous port; ``None`` picks a free one. With several engines, engine ``i``
            listens on ``master_port + i``.
        timeout_seconds: the longest any single wait of a push may take.
        bucket_size_bytes: largest packed bucket on the wire.
        pause_mode: what engines serving during a push do with requests in flight
            (``"keep"``, ``"wait"``, ``"abort"``; see ``VLLMUpdater``).
        lora: how a PEFT LoRA policy is pushed: ``"auto"`` (the adapter alone when every engine
            can serve it, merged weights otherwise), ``"adapter"`` or ``"merged"`` (see
            ``VLLMUpdater`` and ``docs/lora.md``).
        max_staleness: the most versions a rollout may lag the trainer; ``None`` for no limit.
        generate_timeout_seconds: the longest one :meth:`generate` may take (10 minutes by
            default: long rollouts are legitimate, a frozen engine is not).
        updater: a ready ``VLLMUpdater`` to use instead of building one from the arguments above
            (which must then stay at their defaults).
        blocking: ``True`` (default): a push point holds the training step until the engine
            has the weights. ``False``: the push point copies the weights into memory kept
            between pushes and training goes on while a background thread sends them; the
            version is committed (and logged) when the engine has loaded them. The push at fit
            start, and a final one for a push point skipped at the end, always block. See
            ``docs/concepts.md``.
        when_busy: with ``blocking=False``, what a push point does while the previous push is
            still in flight: ``"skip"`` (default: logged as ``vllm/sync_skipped``; the next push
            point sends the newer weights) or ``"wait"``.
        changed_only: send only the layer groups written since the last push (see ``VLLMUpdater``).
        on_sync_error: ``"raise"`` (default) ends training when a push fails; ``"warn"`` warns,
            logs ``vllm/sync_failures`` (failed pushes so far) and goes on training: the engine
            keeps serving its last good weights, the next push point connects again (a server
            restarted on the same URL is picked up), and each failed push counts as a version
            the engine missed for ``max_staleness``. Errors that no retry can fix (a
            misconfigured engine, weights that do not fit it) are raised either way.

    Raises:
        ValueError: for an argument out of range, or two that conflict (``engine`` and ``updater``;
            ``updater`` with settings it would ignore; ``when_busy`` without ``blocking=False``;
            ``blocking=False`` with ``max_staleness=0``): see ``lightning_vllm.options``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from vllm import LLM  # doctest: +SKIP
        >>> llm = LLM(model=path, dtype="float32", weight_transfer_config={"backend": "gloo"})  # doctest: +SKIP
        >>> trainer = Trainer(callbacks=[VLLMWeightSync(engine=llm, every_n_train_steps=4)])  # doctest: +SKIP
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        every_n_train_steps: int | None = 1,
        every_n_epochs: int | None = None,
        push_on_fit_start: bool = True,
        model_attribute: str | None = None,
        backend: str = "auto",
        master_address: str | None = None,
        master_port: int | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        pause_mode: PauseMode = "keep",
        lora: LoraMode = "auto",
        max_staleness: int | None = None,
        generate_timeout_seconds: float = DEFAULT_GENERATE_TIMEOUT_SECONDS,
        updater: VLLMUpdater | None = None,
        on_sync_error: Literal["raise", "warn"] = "raise",
        blocking: bool = True,
        when_busy: WhenBusy = "skip",
        changed_only: bool = True,
    ) -> None:
        updater_options = UpdaterOptions(
            master_address=master_address,
            master_port=master_port,
            backend=backend,
            bucket_size_bytes=bucket_size_bytes,
            timeout_seconds=timeout_seconds,
            model_attribute=model_attribute,
            pause_mode=pause_mode,
            lora=lora,
            changed_only=changed_only,
        )
        num_engines = len(engine) if isinstance(engine, (list, tuple)) else int(engine is not None)
        check_options(
            SyncOptions(
                updater=updater_options,
                num_engines=len(updater.engines) if isinstance(updater, VLLMUpdater) else num_engines,
                updater_given=updater is not None,
                engine_given=engine is not None,
                every_n_train_steps=every_n_train_steps or 0,
                every_n_epochs=every_n_epochs or 0,
                max_staleness=max_staleness,
                generate_timeout_seconds=generate_timeout_seconds,
                on_sync_error=on_sync_error,
                blocking=blocking,
                when_busy=when_busy,
            )
        )
        self.schedule = PushSchedule(every_n_train_steps or 0, every_n_epochs or 0)
        self.on_sync_error = on_sync_error
        self.sync_failures = 0
        self.push_on_fit_start = push_on_fit_start
        # vllm.LLM arguments: the engine is built on global rank 0 in setup.
        self._engine_args = dict(engine) if isinstance(engine, Mapping) else None
        self.updater = updater or VLLMUpdater(
            engine=None if self._engine_args is not None else engine,
            **vars(updater_options),
        )
        self.rollouts = RolloutSampler(self.updater, max_staleness, generate_timeout_seconds)
        self.pusher = None if blocking else BackgroundPusher(self.updater, when_busy)
        self._unsent_push_points = 0  # skipped since the last push that started
        self._last_global_step_pushed = -1
        self._ranks: TrainerRanks | None = None  # the trainer's ranks, when there are several
        self._sharded = False

    @property
    def weight_version(self) -> int:
        """The version of the weights last pushed."""
        return self.updater.weight_version

    @property
    def push_in_flight(self) -> bool:
        """Whether a background push (``blocking=False``) is on its way; rollouts meanwhile come from
        the last committed version, which their ``weight_version`` says."""
        return self.pusher is not None and self.pusher.in_flight()

    @property
    def max_staleness(self) -> int | None:
        """The most versions a rollout may lag the trainer (``None``: no limit)."""
        return self.rollouts.max_staleness

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_train_steps=self.schedule.every_n_train_steps, every_n_epochs=self.schedule.every_n_epochs
        )

    # -- hooks ------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero or self.updater.engine is not None:
            return
        if self._engine_args is None:
            raise ValueError(
                "VLLMWeightSync on global rank 0 has no vLLM engine: pass engine=... (e.g. a vllm.LLM built with "
                "weight_transfer_config={'backend': 'gloo'})."
            )
        self.updater.set_engine(build_local_engine(self._engine_args))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy has set up the model, so the weights are the ones trained
        # and sharded parameters are visible.
        if trainer.world_size > 1:
            self._join_ranks(trainer, pl_module)
        if self.pusher is not None and trainer.is_global_zero:
            self.pusher.check_engines()
        if self.push_on_fit_start:
            self._push(trainer, pl_module, background=False)  # forms the groups; the first rollouts need it

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._collect(trainer)
        self._log_staleness(trainer)
        if self.schedule.due_after_batch(trainer.global_step, self._last_global_step_pushed):
            self._push(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epochs_done = trainer.current_epoch + 1
        if self.schedule.due_after_epoch(epochs_done, trainer.global_step, self._last_global_step_pushed):
            self._push(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.pusher is None:
            return
        # The engine ends on the weights of the last push point: the push in flight lands (its
        # error, if any, is raised here), and a skipped push point is sent now. Every rank
        # knows whether one was skipped: the count travels with the versions (``_share_versions``).
        try:
            try:
                self.pusher.wait_or_raise("at the end of fitting")
            except WeightSyncTimeoutError as error:
                return self._failed(trainer, error)
            self._collect(trainer)
        finally:
            self._share_versions()
        if self._unsent_push_points:
            self._push(trainer, pl_module, background=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()

    def _join_ranks(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank: a status group of the trainer's ranks; whether all take part in pushes
        (a sharded policy), and whether rank 0 generates for ranks that hold no engine."""
        self._ranks = TrainerRanks(self.updater.timeout_seconds, self.rollouts.timeout_seconds)
        self._sharded = is_sharded(trainer.strategy.model or pl_module)
        if self._sharded and self.pusher is not None:
            rank_zero_warn(
                "VLLMWeightSync(blocking=False) pushes a sharded policy blocking: its gathers are collectives "
                "of every rank and run in the training loop's thread."
            )
        every_rank_has_an_engine = self._ranks.every_rank(bool(self.updater.engines))
        self.rollouts.ranks = None if every_rank_has_an_engine else self._ranks

    def _release(self) -> None:
        if self.pusher is not None:
            self.pusher.close()  # the push in flight ends (bounded by timeout_seconds) before the groups close
        self.updater.close()
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = self.rollouts.ranks = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"weight_version": self.updater.weight_version, "last_global_step_pushed": self._last_global_step_pushed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Never back: the engine may already serve a later version than the checkpoint's.
        self.updater.weight_version = max(self.updater.weight_version, state_dict.get("weight_version", 0))
        self._last_global_step_pushed = state_dict.get("last_global_step_pushed", -1)

    # -- rollouts -----------------------------------------------------------------

    def generate(
        self,
        prompts: Any,
        sampling_params: Any = None,
        *,
        worker_id: int = 0,
        timeout_seconds: float | None = None,
        pad_token_id: int | None = None,
    ) -> list[Generation]:
        """Sample from the engine this callback keeps in sync, one entry per sample.

        Args:
            prompts: token-id lists (batch them with ``DataLoader(..., collate_fn=list)``), texts
                when the engine has a tokenizer, or a 2-D integer tensor with one row per prompt.
            sampling_params: vLLM ``SamplingParams`` (``n`` samples per prompt, logprobs, ...).
            worker_id: which engine, when the callback updates several.
            timeout_seconds: the longest this call may take (default: ``generate_timeout_seconds``).
            pad_token_id: for a tensor of prompts, the padding id stripped from both ends of each row.

        Returns:
            Per sample: generated token ids, their logprobs (if asked), text (if the engine
            has a tokenizer) and the weight version that produced it.

        Raises:
            TypeError, ValueError: prompts vLLM cannot take; nothing reached the engine.
            WeightSyncTimeoutError: the engine did not answer in time.
            EngineDeadError: the engine died.
            StaleRolloutsError: a sample is more than ``max_staleness`` versions behind.
        """
        return self.rollouts.generate(
            prompts, sampling_params, worker_id=worker_id, timeout_seconds=timeout_seconds, pad_token_id=pad_token_id
        )

    def _log_staleness(self, trainer: pl.Trainer) -> None:
        staleness = self.rollouts.take_staleness()
        if staleness is None:
            return
        for logger in trainer.loggers:
            logger.log_metrics({"vllm/staleness": float(staleness)}, step=trainer.global_step)

    # -- pushing ----------------------------------------------------------------

    def _push(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool = True) -> None:
        self._last_global_step_pushed = trainer.global_step
        if trainer.sanity_checking:
            return
        try:
            self._push_now(trainer, pl_module, background and self.pusher is not None and not self._sharded)
        except WeightSyncError as error:
            self._failed(trainer, error)

    def _push_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool) -> None:
        if self._ranks is not None and self._sharded:  # every rank gathers, rank 0 sends
            # The strategy's model: FSDPStrategy wraps the LightningModule, whose root unit owns
            # the parameters no sub-module unit does.
            start = time.perf_counter()
            stats = push_from_every_rank(self.updater, trainer.strategy.model or pl_module, self._ranks)
            self._unsent_push_points = 0
            if stats is not None:
                self._log(trainer, stats, stall_seconds=time.perf_counter() - start)
            return
        # Every rank holds the full weights (DDP, or one process): rank 0 alone sends, then
        # tells the others the versions, which they need for staleness.
        try:
            if trainer.is_global_zero:
                self._push_from_rank_zero(trainer, pl_module, background)
        finally:
            self._share_versions()

    def _push_from_rank_zero(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool) -> None:
        if background:
            return self._submit(trainer, pl_module)
        start = time.perf_counter()
        if self.pusher is not None:  # a blocking push after background ones: they end first
            self.pusher.wait_or_raise("before a blocking push")
            self._collect(trainer)
        try:
            stats = self.updater.push_weights(pl_module)
        except PartialPushError as error:
            self._unsent_push_points = 0
            self._log(trainer, cast(SyncStats, error.stats), stall_seconds=time.perf_counter() - start)
            raise
        self._unsent_push_points = 0
        log.debug("Pushed weight version %d in %.3f s", stats.weight_version, stats.seconds)
        self._log(trainer, stats, stall_seconds=time.perf_counter() - start)

    def _share_versions(self) -> None:
        """Under DDP, global rank 0's versions (and skipped push points) on every rank; a collective
        of every rank at each push point. Sharded pushes share them themselves."""
        if self._ranks is None or self._sharded:
            return
        values = [*self.updater.versions.as_ints(), self._unsent_push_points]
        shared = self._ranks.broadcast_ints(values)
        if self._ranks.rank != 0:
            self.updater.versions.adopt(shared[:-1])
            self._unsent_push_points = shared[-1]

    def _submit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.pusher is not None
        self._collect(trainer)  # a push that ended says how it went before the next one starts
        submitted = self.pusher.submit(pl_module)
        if submitted.landed is not None:  # when_busy="wait": the push waited for
            self._log(trainer, submitted.landed)
        metrics = {"vllm/sync_stall_seconds": submitted.stall_seconds}
        if submitted.started:
            self._unsent_push_points = 0
        else:
            self._unsent_push_points += 1
            metrics["vllm/sync_skipped"] = float(self.pusher.num_skipped)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _collect(self, trainer: pl.Trainer) -> None:
        """Log the background push that landed since the last look, or handle its error."""
        if self.pusher is None:
            return
        try:
            stats = self.pusher.collect()
        except PartialPushError as error:
            self._log(trainer, cast(SyncStats, error.stats))
            return self._failed(trainer, error)
        except WeightSyncError as error:
            return self._failed(trainer, error)
        if stats is not None:
            self._log(trainer, stats)

    def _failed(self, trainer: pl.Trainer, error: WeightSyncError) -> None:
        # (The updater has counted the push point as missed, unless some engine took it.)
        if self.on_sync_error == "raise" or isinstance(error, (EngineConfigError, WeightsMismatchError)):
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
        }
        if stall_seconds is not None:  # a background push's stall was logged at its push point
            metrics["vllm/sync_stall_seconds"] = stall_seconds
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
