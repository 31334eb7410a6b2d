"""The arguments of ``VLLMWeightSync`` and ``VLLMUpdater``, checked together by one pure function.

Options that conflict (an option another one makes meaningless, two that cannot both
hold) are refused at construction with an error that names both, instead of being
ignored or failing later depending on timing. :func:`check_options` is a pure
function of :class:`SyncOptions`, so every combination is tested without an engine.

Each rule is written once, here: :func:`check_options` and :func:`check_updater_options` apply them all; the parts
usable on their own (a ``BackgroundPusher``, a ``RolloutSampler``) apply the same ones (:func:`check_choice`,
:func:`check_max_staleness`), and ``settings.py`` holds the timeout's and the bucket size's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from lightning_vllm.settings import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DEFAULT_GENERATE_TIMEOUT_SECONDS,
    DEFAULT_TIMEOUT_SECONDS,
    validate_bucket_size,
    validate_timeout,
)

PauseMode = Literal["abort", "wait", "keep"]
"""How requests in flight are treated while weights change (vLLM's ``pause_generation`` modes):
``"keep"`` freezes them and resumes them afterwards (nothing is lost), ``"wait"`` lets them
finish first, ``"abort"`` drops them."""

LoraMode = Literal["auto", "adapter", "merged"]
"""How a PEFT LoRA policy is pushed: ``"adapter"`` sends the adapter alone (the engine
serves it as a LoRA), ``"merged"`` sends base + adapter merged into full weights,
``"auto"`` sends the adapter whenever every engine can serve it, merged weights otherwise."""

WhenBusy = Literal["skip", "wait"]
"""What a push point does while the previous push is still in flight: ``"skip"`` (training goes
on; the next push point sends the newer weights) or ``"wait"`` (the training loop waits for it)."""

PushFrom = Literal["rank0", "every_rank"]
"""Which trainer ranks send a sharded policy: ``"rank0"`` gathers it on every rank and rank 0
sends it (no port beyond the sync's one); ``"every_rank"`` has each rank send its own FSDP2
shard, with no gather, from a port of its own (``every_rank.py``, ``docs/multinode.md``)."""

SleepLevel = Literal[1, 2]
"""vLLM's sleep levels that free GPU memory for training: 1 keeps a host copy of the weights (woken for the next
push), 2 drops them (the next push sends every layer). vLLM's level 0 only pauses scheduling: not a sleep here."""

_MAX_PORT = 65535


@dataclass(frozen=True)
class UpdaterOptions:
    """How a push connects and sends: the settings of ``WeightSync`` and ``VLLMUpdater`` (see their
    docstrings; the defaults are theirs), stored once, in this object, by whoever holds them."""

    master_address: str | None = None
    master_port: int | None = None
    vllm_tp_size: int | None = None
    backend: str = "auto"
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    model_attribute: str | None = None
    pause_mode: PauseMode = "keep"
    lora: LoraMode = "auto"
    changed_only: bool = True
    reset_prefix_cache: bool = True
    verify_pushes: bool = True
    sleep_level: SleepLevel | None = None

    @property
    def address(self) -> str:
        """The address the trainer listens on: ``master_address``, loopback when not given."""
        return self.master_address or "127.0.0.1"

    def engine_port(self, index: int) -> int | None:
        """The rendezvous port of the engine at ``index``: a fixed ``master_port`` is the first of one
        port per engine (each engine's group has a rendezvous of its own); ``None``: a free one."""
        return self.master_port + index if self.master_port else self.master_port

    @classmethod
    def among(cls, arguments: Mapping[str, Any]) -> UpdaterOptions:
        """The options among a front end's ``arguments`` (its ``locals()``): those named as fields here."""
        return cls(**{field.name: arguments[field.name] for field in fields(cls) if field.name in arguments})

    def given(self) -> list[str]:
        """The names of the settings that differ from the defaults."""
        default = UpdaterOptions()
        return [field.name for field in fields(self) if getattr(self, field.name) != getattr(default, field.name)]


@dataclass(frozen=True)
class SyncOptions:
    """Everything ``VLLMWeightSync`` is built with, as :func:`check_options` judges it.

    Attributes:
        updater: the updater's settings, as passed to the callback (or to the updater).
        num_engines: how many engines the updater pushes to (0: none on this rank, or not known yet).
        updater_given: the callback was handed a ready ``VLLMUpdater`` (``updater=``).
        engine_given: the callback was handed an engine (``engine=``).
    """

    updater: UpdaterOptions = UpdaterOptions()
    num_engines: int = 1
    updater_given: bool = False
    engine_given: bool = False
    every_n_train_steps: int = 1
    every_n_epochs: int = 0
    max_staleness: int | None = None
    generate_timeout_seconds: float = DEFAULT_GENERATE_TIMEOUT_SECONDS
    on_sync_error: str = "raise"
    blocking: bool = True
    when_busy: str = "skip"
    push_from: str = "rank0"


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (the one rule for every option that names a choice).

    Example::

        >>> check_choice("when_busy", "queue", ("skip", "wait"))
        Traceback (most recent call last):
        ...
        ValueError: Invalid value for when_busy='queue'. Must be 'skip' or 'wait'.
    """
    if value not in choices:
        listed = f"{', '.join(map(repr, choices[:-1]))} or {choices[-1]!r}" if len(choices) > 1 else repr(choices[0])
        raise ValueError(f"Invalid value for {name}={value!r}. Must be {listed}.")


def check_max_staleness(max_staleness: int | None) -> None:
    """Raise ``ValueError`` unless ``max_staleness`` is ``None`` or a count of versions, ``>= 0``."""
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"Invalid value for max_staleness={max_staleness}. Must be >= 0, or None.")


def check_updater_options(options: UpdaterOptions, num_engines: int = 1) -> None:
    """Raise ``ValueError`` for a ``VLLMUpdater`` setting out of range or in conflict with another.

    Several engines with a fixed ``master_port`` take one port each, from ``master_port`` on.

    Example::

        >>> check_updater_options(UpdaterOptions(master_port=65535), num_engines=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Invalid value for master_port=65535 with 2 engines: ... at most 65534.
    """
    port = options.master_port
    if port is not None and not 0 <= port <= _MAX_PORT:
        raise ValueError(f"Invalid value for master_port={port}. Must be in [0, 65535], or None.")
    if port and port + num_engines - 1 > _MAX_PORT:
        raise ValueError(
            f"Invalid value for master_port={port} with {num_engines} engines: engine i listens on "
            f"master_port + i, so it must be at most {_MAX_PORT - num_engines + 1}."
        )
    if options.vllm_tp_size is not None and options.vllm_tp_size < 1:
        raise ValueError(f"Invalid value for vllm_tp_size={options.vllm_tp_size}. Must be >= 1.")
    validate_timeout(options.timeout_seconds)
    validate_bucket_size(options.bucket_size_bytes)
    check_choice("pause_mode", options.pause_mode, ("keep", "wait", "abort"))
    check_choice("lora", options.lora, ("auto", "adapter", "merged"))
    level = options.sleep_level
    if level == 0 and not isinstance(level, bool):
        raise ValueError(
            "Invalid value for sleep_level=0: vLLM's level 0 only pauses scheduling, which frees no GPU memory for "
            "training. Pass 1 (weights kept in host memory), 2 (weights dropped, the next push sends every layer), "
            "or None (no sleep)."
        )
    if level is not None and (isinstance(level, bool) or level not in (1, 2)):
        raise ValueError(f"Invalid value for sleep_level={level!r}. Must be 1, 2 or None.")


def check_options(options: SyncOptions) -> list[str]:
    """Raise ``ValueError`` for an argument of ``VLLMWeightSync`` out of range, or in conflict with another.

    Returns:
        What the caller warns about: options another option makes meaningless (kept, ignored).

    Example::

        >>> check_options(SyncOptions(blocking=False, max_staleness=0))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: blocking=False cannot hold max_staleness=0: ... or blocking=True.
    """
    if options.engine_given and options.updater_given:
        raise ValueError("Pass either engine=... or updater=..., not both: the updater already holds its engine.")
    ignored = options.updater.given()
    if options.updater_given and ignored:
        raise ValueError(
            f"updater=... already holds its own settings, so {', '.join(ignored)} would be ignored. Set them on the "
            "VLLMUpdater, or pass engine=... instead of updater=...."
        )
    check_updater_options(options.updater, options.num_engines)
    intervals = {"every_n_train_steps": options.every_n_train_steps, "every_n_epochs": options.every_n_epochs}
    for name, interval in intervals.items():
        if interval < 0:
            raise ValueError(f"Invalid value for {name}={interval}. Must be >= 0.")
    check_max_staleness(options.max_staleness)
    if options.generate_timeout_seconds <= 0:
        raise ValueError(f"Invalid value for generate_timeout_seconds={options.generate_timeout_seconds}. Must be > 0.")
    check_choice("on_sync_error", options.on_sync_error, ("raise", "warn"))
    check_choice("when_busy", options.when_busy, ("skip", "wait"))
    check_choice("push_from", options.push_from, ("rank0", "every_rank"))
    if not options.blocking and options.max_staleness == 0:
        raise ValueError(
            "blocking=False cannot hold max_staleness=0: rollouts sampled while a background push is on its way "
            "are one version behind. Pass max_staleness >= 1, or blocking=True."
        )
    notes = []
    if options.blocking and options.when_busy != "skip":
        notes.append(f"when_busy={options.when_busy!r} is ignored: it applies to background pushes (blocking=False).")
    return notes
