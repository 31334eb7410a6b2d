"""When to send: a Lightning callback that keeps a vLLM engine on the trainer's weights, and its schedule
(:class:`PushSchedule`, the decision alone; ``push_points.py`` acts on it)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import Unpack, override

from lightning_vllm.backends.registry import check_requested
from lightning_vllm.core.weight_sync import HoldsWeightSync, WeightSync
from lightning_vllm.engines import Generation
from lightning_vllm.engines.local import build_local_engine
from lightning_vllm.engines.sleep import WeightsDroppedError
from lightning_vllm.fronts.lightning.background import BackgroundPusher
from lightning_vllm.fronts.lightning.push_points import PushPoints
from lightning_vllm.fronts.lightning.rollouts import GenerateOptions, RolloutSampler, SamplesRollouts
from lightning_vllm.fronts.lightning.sleeping import SleepBetweenSteps
from lightning_vllm.options import (
    LoraMode,
    PauseMode,
    PushFrom,
    SleepLevel,
    SyncOptions,
    UpdaterOptions,
    WhenBusy,
    check_options,
)
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_GENERATE_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushSchedule:
    """When a push is due; ``0`` turns an interval off (``options.check_options`` checks the intervals).

    ``trainer.global_step`` moves only at an optimizer step and stays put for the
    batches of a gradient-accumulation cycle, so a push is due once per step: never
    again at the step last pushed (as ``ModelCheckpoint`` remembers the step it saved).

    Example::

        >>> schedule = PushSchedule(every_n_train_steps=2)
        >>> [step for step in range(1, 7) if schedule.due_after_batch(step, last_pushed_step=-1)]
        [2, 4, 6]
        >>> schedule.due_after_batch(4, last_pushed_step=4)
        False
    """

    every_n_train_steps: int = 0
    every_n_epochs: int = 0

    def due_after_batch(self, global_step: int, last_pushed_step: int) -> bool:
        """Whether to push after a training batch that left the trainer at ``global_step``."""
        every = self.every_n_train_steps
        return bool(every) and global_step > 0 and global_step % every == 0 and global_step != last_pushed_step

    def due_after_epoch(self, epochs_done: int, global_step: int, last_pushed_step: int) -> bool:
        """Whether to push after ``epochs_done`` training epochs, unless this step was just pushed."""
        every = self.every_n_epochs
        return bool(every) and epochs_done % every == 0 and global_step != last_pushed_step


class VLLMWeightSync(Callback, SamplesRollouts):
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
            callback configurable from a LightningCLI YAML file; without a ``weight_transfer_config``
            it gets ``lightning_ipc`` on a GPU and ``gloo`` on CPUs). ``None`` on ranks that
            hold no engine (under DDP, only global rank 0 needs one).
        engine_gpus: for an engine given as a dict: start it on these GPUs (numbered as global rank 0 sees them,
            ``lightning_vllm.engine_on_gpus``), one tensor-parallel rank each and ``lightning_nccl`` unless the dict
            says otherwise; keep them out of the Trainer's ``devices``.
        every_n_train_steps: push after every N optimizer steps; ``None`` or 0 turns it off.
        every_n_epochs: push at the end of every N training epochs; ``None`` or 0 turns it off.
        push_on_fit_start: push once before the first training step.
        model_attribute: LightningModule attribute holding the Hugging Face model;
            found automatically when ``None``.
        backend: ``"auto"``, ``"gloo"``, ``"nccl"``, ``"ipc"``, ``"lightning_ipc"`` or ``"lightning_nccl"`` (see
            ``VLLMUpdater``).
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
        updater: a ready ``WeightSync``, or a front end that has one (a ``VLLMUpdater``: the callback pushes through
            its core), to use instead of building one from the arguments above (which must then stay at their
            defaults).
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
        verify_pushes: check what each engine holds after every push, per layer (on by default; see
            ``VLLMUpdater``).
        push_from: which trainer ranks send a sharded (FSDP2) policy: ``"rank0"`` (default) gathers
            it on every rank and rank 0 sends it, through the sync's one port; ``"every_rank"`` has
            each rank send its own shard, with no gather, so every trainer host's link carries
            bytes. Rank ``k > 0`` then listens on ``master_port + (number of engines - 1) + k`` (a
            free port without ``master_port``) at its address on the route to ``master_address``
            (or ``$LIGHTNING_VLLM_SEND_ADDRESS``). Needs the gloo backend; a policy with no
            shard per rank (FSDP1, ZeRO-3, LoRA) is gathered as with ``"rank0"``, with a warning.
            See ``docs/multinode.md``.
        on_sync_error: ``"raise"`` (default) ends training when a push fails; ``"warn"`` warns,
            logs ``vllm/sync_failures`` (failed pushes so far) and goes on training: the engine
            keeps serving its last good weights, the next push point connects again (a server
            restarted on the same URL is picked up), and each failed push counts as a version
            the engine missed for ``max_staleness``. Errors that no retry can fix (a
            misconfigured engine, weights that do not fit it) are raised either way.
        sleep_level: put the engines to sleep while the trainer steps (colocated training; engines started with
            ``enable_sleep_mode=True``): ``1`` keeps a host copy of the weights, ``2`` drops them. ``None`` (default):
            no sleep. The engines sleep before every backward; a push point wakes the weights alone (a push after a
            level-2 sleep sends every layer), and :meth:`generate` wakes the rest. With ``2``, rollouts after a step
            with no push due push first (the weights are gone). A push that finds an engine asleep wakes its weights
            whatever this is; see ``docs/sleep.md``.
        progress_bar: show the weight version and the last push's seconds on Lightning's progress bar
            (``vllm/weight_version``, ``vllm/sync_seconds``); ``False`` leaves the bar alone. The loggers get them
            either way.
        reset_prefix_cache: reset vLLM's prefix cache after each push, so that no rollout reuses KV computed with
            the old weights (see ``VLLMUpdater``).
        vllm_tp_size: vLLM's tensor-parallel size, checked against each engine before a byte moves when given.

    Raises:
        ValueError: for an argument out of range, or two that conflict (``engine`` and ``updater``;
            ``updater`` with settings it would ignore; ``blocking=False`` with ``max_staleness=0``):
            see ``lightning_vllm.options``. An option another makes meaningless (``when_busy``
            without ``blocking=False``) is warned about.

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
        engine_gpus: Sequence[int] = (),
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
        updater: WeightSync | HoldsWeightSync | None = None,
        on_sync_error: Literal["raise", "warn"] = "raise",
        blocking: bool = True,
        when_busy: WhenBusy = "skip",
        changed_only: bool = True,
        verify_pushes: bool = True,
        push_from: PushFrom = "rank0",
        sleep_level: SleepLevel | None = None,
        progress_bar: bool = True,
        reset_prefix_cache: bool = True,
        vllm_tp_size: int | None = None,
    ) -> None:
        updater_options = UpdaterOptions.among(locals())
        if isinstance(updater, HoldsWeightSync):  # (TorchRL's updater: the callback pushes through its core)
            updater = updater.weight_sync
        num_engines = len(engine) if isinstance(engine, (list, tuple)) else int(engine is not None)
        ignored = check_options(
            SyncOptions(
                updater=updater_options,
                num_engines=len(updater.engines) if isinstance(updater, WeightSync) else num_engines,
                updater_given=updater is not None,
                engine_given=engine is not None,
                every_n_train_steps=every_n_train_steps or 0,
                every_n_epochs=every_n_epochs or 0,
                max_staleness=max_staleness,
                generate_timeout_seconds=generate_timeout_seconds,
                on_sync_error=on_sync_error,
                blocking=blocking,
                when_busy=when_busy,
                push_from=push_from,
            )
        )
        check_requested(backend, every_rank=push_from == "every_rank")
        for note in ignored:
            rank_zero_warn(note)
        self.schedule = PushSchedule(every_n_train_steps or 0, every_n_epochs or 0)
        self.push_on_fit_start = push_on_fit_start
        # vllm.LLM arguments: the engine is built on global rank 0 in setup.
        self._engine_args = dict(engine) if isinstance(engine, Mapping) else None
        if engine_gpus and self._engine_args is None:
            raise ValueError(
                "engine_gpus places an engine the callback builds from a dict of vllm.LLM arguments (engine={...}); "
                "start your own engine inside lightning_vllm.engine_on_gpus(...) instead."
            )
        self._engine_gpus = tuple(engine_gpus)
        self.updater = updater or WeightSync(None if self._engine_args is not None else engine, options=updater_options)
        self.rollouts = RolloutSampler(self.updater, max_staleness, generate_timeout_seconds)
        self.push_points = PushPoints(self.updater, blocking, when_busy, on_sync_error, push_from)
        self.sleep = SleepBetweenSteps(self.updater, self.push_points.pusher)
        self.progress_bar = progress_bar
        self._last_global_step_pushed = -1
        self._trainer: pl.Trainer | None = None  # (while fitting: rollouts that meet dropped weights push first)

    @property
    def pusher(self) -> BackgroundPusher | None:
        """The background pusher (``blocking=False``), ``None`` for blocking pushes."""
        return self.push_points.pusher

    @property
    def sync_failures(self) -> int:
        """Pushes that failed so far (``on_sync_error="warn"``)."""
        return self.push_points.sync_failures

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
        self.updater.set_engine(build_local_engine(self._engine_args, self._engine_gpus))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy has set up the model, so the weights are the ones trained
        # and sharded parameters are visible.
        if trainer.world_size > 1:
            ranks = self.push_points.join_ranks(trainer, pl_module, self.rollouts.timeout_seconds)
            # Rank 0 generates for the ranks that hold no engine.
            self.rollouts.ranks = None if ranks.every_rank(bool(self.updater.engines)) else ranks
        if self.pusher is not None and trainer.is_global_zero:
            self.pusher.check_engines()
        self.sleep.check()
        self._trainer = trainer
        if self.push_on_fit_start:
            self._push(trainer, pl_module, background=False)  # forms the groups; the first rollouts need it

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.push_points.collect(trainer)
        self._log_staleness(trainer)
        if self.schedule.due_after_batch(trainer.global_step, self._last_global_step_pushed):
            self._push(trainer, pl_module)
        if self.progress_bar:
            self._show_on_progress_bar(pl_module)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.sleep.before_backward(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.schedule.due_after_epoch(trainer.current_epoch + 1, trainer.global_step, self._last_global_step_pushed):
            self._push(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.push_points.end_of_fit(trainer, pl_module)
        self.sleep.wake_after_fit()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        self._trainer = None
        self.push_points.release()
        self.rollouts.ranks = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"weight_version": self.updater.weight_version, "last_global_step_pushed": self._last_global_step_pushed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Never back: the engine may already serve a later version than the checkpoint's.
        self.updater.weight_version = max(self.updater.weight_version, state_dict.get("weight_version", 0))
        self._last_global_step_pushed = state_dict.get("last_global_step_pushed", -1)

    # -- rollouts -----------------------------------------------------------------

    @override
    def generate(
        self, prompts: Any, sampling_params: Any = None, **options: Unpack[GenerateOptions]
    ) -> list[Generation]:
        """Sample from the engine this callback keeps in sync, one entry per sample, each with the weight version
        that produced it. ``RolloutSampler.generate`` (``fronts/lightning/rollouts.py``) says what it takes (the
        prompts, vLLM ``SamplingParams``, and ``engine_index``, ``timeout_seconds`` and ``pad_token_id``:
        ``GenerateOptions``), returns and raises.

        Example::

            >>> from vllm import SamplingParams  # doctest: +SKIP
            >>> rollouts = sync.generate([[1, 2, 3]], SamplingParams(max_tokens=8), engine_index=0)  # doctest: +SKIP
        """
        try:
            return self.rollouts.generate(prompts, sampling_params, **options)
        except WeightsDroppedError as error:
            trainer = self._trainer
            if trainer is None:
                raise
            if self.sleep.pushes_first(error, trainer.world_size):  # (else: the push on its way refilled them)
                self._push(trainer, trainer.lightning_module, background=False)
            return self.rollouts.generate(prompts, sampling_params, **options)

    def _show_on_progress_bar(self, pl_module: pl.LightningModule) -> None:
        # (Through the module's log, as the bar reads it; the loggers were given the figures at each push.)
        shown = {"vllm/weight_version": float(self.weight_version)}
        if self.updater.last_sync is not None:
            shown["vllm/sync_seconds"] = self.updater.last_sync.seconds
        pl_module.log_dict(shown, prog_bar=True, logger=False, on_step=True, on_epoch=False, rank_zero_only=True)

    def _log_staleness(self, trainer: pl.Trainer) -> None:
        staleness = self.updater.versions.take_staleness()
        if staleness is None:
            return
        for logger in trainer.loggers:
            logger.log_metrics({"vllm/staleness": float(staleness)}, step=trainer.global_step)

    def _push(self, trainer: pl.Trainer, pl_module: pl.LightningModule, background: bool = True) -> None:
        self._last_global_step_pushed = trainer.global_step
        self.push_points.push(trainer, pl_module, background)
