"""Rollouts from inside ``training_step``: sampling from the engines kept in sync, and staleness.

Every prompt is checked before it reaches vLLM (``prompts.py``), and every generate
is bounded by a timeout: a mistake or a frozen engine ends in a clear error, never
in a training step that waits forever. Each sample carries the weight version that
produced it. A :class:`RolloutSampler` remembers the oldest version sampled since
the trainer last asked, so the callback can log ``vllm/staleness`` and refuse
rollouts older than ``max_staleness``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import lightning.pytorch as pl
from typing_extensions import Unpack

from lightning_vllm._waits import BackgroundCall, call_with_timeout, wait_polling
from lightning_vllm.core import after_failure
from lightning_vllm.engines import EngineTarget, Generation
from lightning_vllm.engines.failures import is_engine_death, is_paused_refusal, raise_if_dead, retry_delay
from lightning_vllm.engines.sleep import sleeping_engine, wake_for_rollouts
from lightning_vllm.errors import (
    EngineDeadError,
    StaleRolloutsError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from lightning_vllm.fronts.lightning.ranks import TrainerRanks
from lightning_vllm.options import check_max_staleness
from lightning_vllm.prompts import PromptLimits, checked_prompts
from lightning_vllm.settings import DEFAULT_GENERATE_TIMEOUT_SECONDS, validate_timeout

if TYPE_CHECKING:
    from lightning_vllm.core.weight_sync import WeightSync

log = logging.getLogger(__name__)

# How often a waiting generate asks whether the engine died (a cheap flag read).
_DEATH_POLL_SECONDS = 0.2
# A share's own generate ends by its deadline; its thread is given this much more to hand the error back.
_SPREAD_GRACE_SECONDS = 5.0


class GenerateOptions(TypedDict, total=False):
    """The keyword options every ``generate`` takes (``VLLMWeightSync.generate``, ``lightning_vllm.generate``,
    :meth:`RolloutSampler.generate`).

    Attributes:
        engine_index: which engine (its position in ``engine=``) samples every prompt; by default (``None``) the
            prompts are spread over every engine the callback updates, in contiguous shares sampled at once.
        timeout_seconds: the longest the call may take (default: the callback's ``generate_timeout_seconds``).
        pad_token_id: for a tensor of prompts, the padding id stripped from both ends of each row.
    """

    engine_index: int | None
    timeout_seconds: float | None
    pad_token_id: int | None


def _checked_options(options: GenerateOptions) -> GenerateOptions:
    """``options`` with every default filled in; raises ``TypeError`` naming an option ``generate`` does not take."""
    unknown = sorted(set(options) - GenerateOptions.__optional_keys__)
    if unknown:
        raise TypeError(
            f"generate() got unexpected keyword argument(s) {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(GenerateOptions.__optional_keys__))}."
        )
    return {"engine_index": None, "timeout_seconds": None, "pad_token_id": None, **options}


class RolloutSampler:
    """Samples from an updater's engines and keeps track of how stale the samples are.

    Args:
        updater: the updater whose engines are sampled and whose version is the trainer's.
        max_staleness: the most versions a sample may lag the trainer; ``None`` for no limit.
        timeout_seconds: the longest one :meth:`generate` may take unless the call says otherwise.
    """

    def __init__(
        self,
        updater: WeightSync,
        max_staleness: int | None = None,
        timeout_seconds: float = DEFAULT_GENERATE_TIMEOUT_SECONDS,
    ) -> None:
        check_max_staleness(max_staleness)
        validate_timeout(timeout_seconds)
        self.updater = updater
        self.max_staleness = max_staleness
        self.timeout_seconds = timeout_seconds
        # Set when this rank holds no engine and rank 0 generates for every rank.
        self.ranks: TrainerRanks | None = None
        # A generate that timed out keeps running on its thread; the next one on the
        # same engine waits for it, so two never drive one engine at once.
        self._timed_out: dict[int, BackgroundCall[list[Generation]]] = {}

    def generate(
        self, prompts: Any, sampling_params: Any = None, **options: Unpack[GenerateOptions]
    ) -> list[Generation]:
        """Sample from the engine at ``options["engine_index"]``; one entry per sample, each with its weight version.

        Args:
            prompts: token-id lists (batch them with ``DataLoader(..., collate_fn=list)``), strings (engines with a
                tokenizer) or a 2-D integer tensor, one row per prompt (see ``lightning_vllm.prompts``).
            sampling_params: vLLM ``SamplingParams`` (``n`` samples per prompt, logprobs, ...); vLLM's defaults when
                ``None``.
            **options: ``engine_index``, ``timeout_seconds`` (default: ``self.timeout_seconds``), ``pad_token_id``
                (:class:`GenerateOptions`).

        Returns:
            Per sample: generated token ids, their logprobs (if asked), text (if the engine has a tokenizer) and the
            weight version that produced it.

        Raises:
            TypeError, ValueError: prompts vLLM cannot take, or an unknown option; nothing reached the engine.
            WeightSyncTimeoutError: the engine did not answer within the timeout.
            EngineDeadError: the engine died.
            StaleRolloutsError: a sample is more than ``max_staleness`` versions behind.
        """
        checked = _checked_options(options)
        if self.ranks is not None:
            generations = self._generate_on_rank_zero(prompts, sampling_params, checked)
        else:
            generations = self._generate_here(prompts, sampling_params, checked)
        self.record([generation.weight_version for generation in generations])
        return generations

    def _generate_on_rank_zero(self, prompts: Any, sampling_params: Any, options: GenerateOptions) -> list[Generation]:
        """Every rank's prompts generated in one batch by rank 0's engine; each rank gets its own back.

        A collective: every rank calls it at the same point. Prompts and results travel
        as JSON, never pickled. A rank whose prompts are refused makes every rank raise.
        """
        assert self.ranks is not None
        try:
            request: dict[str, Any] = {
                "prompts": checked_prompts(prompts, PromptLimits(), pad_token_id=options["pad_token_id"])
            }
        except (TypeError, ValueError) as error:  # still take part, so no rank waits for this one
            request = {"error": _error_record(error)}
        requests = [json.loads(payload) for payload in self.ranks.gather_to_rank_zero(json.dumps(request).encode())]
        reply: dict[str, Any] = {}
        if self.ranks.rank == 0:
            reply = self._serve_ranks(requests, sampling_params, options)
        reply = json.loads(self.ranks.broadcast_bytes(json.dumps(reply).encode()))
        if "error" in reply:
            raise _RAISABLE.get(reply["error"]["type"], WeightSyncError)(reply["error"]["message"])
        return [_generation_from_record(record) for record in reply["generations"][self.ranks.rank]]

    def _serve_ranks(
        self, requests: list[dict[str, Any]], sampling_params: Any, options: GenerateOptions
    ) -> dict[str, Any]:
        refused = [(rank, request["error"]) for rank, request in enumerate(requests) if "error" in request]
        if refused:
            rank, record = refused[0]
            return {"error": {**record, "message": f"Trainer rank {rank}: {record['message']}"}}
        prompts = [prompt for request in requests for prompt in request["prompts"]]
        try:
            generations = self._generate_here(prompts, sampling_params, {**options, "pad_token_id": None})
        except Exception as error:  # noqa: BLE001  # every rank raises it
            return {"error": _error_record(error)}
        per_prompt = len(generations) // len(prompts) if prompts else 0  # vLLM returns n samples per prompt
        by_rank, start = [], 0
        for request in requests:
            stop = start + per_prompt * len(request["prompts"])
            by_rank.append([dataclasses.asdict(generation) for generation in generations[start:stop]])
            start = stop
        return {"generations": by_rank}

    def _generate_here(self, prompts: Any, sampling_params: Any, options: GenerateOptions) -> list[Generation]:
        engine_index, timeout_seconds = options["engine_index"], options["timeout_seconds"]
        if engine_index is None:
            return self._spread(prompts, sampling_params, options)
        engine = self._engine(engine_index)
        raise_if_dead(engine)
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        validate_timeout(timeout)
        deadline = time.monotonic() + timeout
        limits = call_with_timeout(engine.prompt_limits, timeout=timeout, what=f"{engine.description}'s limits")
        checked = checked_prompts(prompts, limits, pad_token_id=options["pad_token_id"])
        if not checked:
            return []
        if sampling_params is None:
            from vllm import SamplingParams

            sampling_params = SamplingParams()
        self._await_timed_out(engine_index, engine, deadline)
        # A failed nccl/ipc push may have left the engine's layers mid-reload, which its cleanup puts back.
        after_failure.wait_for(engine, max(deadline - time.monotonic(), 0.0))
        if (sleeps := sleeping_engine(engine)) is not None:  # (sleep mode: awake, and never from dropped weights)
            wake_for_rollouts(sleeps, timeout)
        # vLLM 0.33 refuses new requests while a push holds generation paused ("wait" and "abort" modes);
        # the refusal is immediate and the pause short, so the same request is asked again until the deadline.
        for attempt in itertools.count():
            try:
                return self._generate_once(engine, engine_index, checked, sampling_params, timeout, deadline)
            except Exception as error:
                if not is_paused_refusal(error):
                    raise
                if time.monotonic() + retry_delay(attempt) > deadline:
                    raise WeightSyncTimeoutError(
                        f"{engine.description} refused the request for {timeout:g} s: generation stayed paused "
                        f"({error}). A push may be stuck; or raise timeout_seconds (generate_timeout_seconds of "
                        "VLLMWeightSync)."
                    ) from error
                log.debug("%s refused the request while paused (%s); retrying.", engine.description, error)
                time.sleep(retry_delay(attempt))
        raise AssertionError("unreachable")

    def _spread(self, prompts: Any, sampling_params: Any, options: GenerateOptions) -> list[Generation]:
        """The prompts in contiguous shares, one per engine, sampled at once; the samples in the prompts' order."""
        num_engines = len(self.updater.engines)
        if num_engines <= 1:
            return self._generate_here(prompts, sampling_params, {**options, "engine_index": 0})
        rows = checked_prompts(prompts, PromptLimits(), pad_token_id=options["pad_token_id"])  # (as lists)
        bounds = [len(rows) * share // num_engines for share in range(num_engines + 1)]
        calls = [
            BackgroundCall(
                self._generate_here,
                rows[start:stop],
                sampling_params,
                {**options, "engine_index": index, "pad_token_id": None},
                what=f"engine {index} to generate",
            )  # fmt: skip
            for index, (start, stop) in enumerate(zip(bounds, bounds[1:]))
            if stop > start
        ]
        timeout = options["timeout_seconds"] or self.timeout_seconds
        return [generation for call in calls for generation in call.result(timeout + _SPREAD_GRACE_SECONDS)]

    def _generate_once(
        self,
        engine: EngineTarget,
        engine_index: int,
        checked: list[Any],
        sampling_params: Any,
        timeout: float,
        deadline: float,
    ) -> list[Generation]:
        call = BackgroundCall(
            engine.generate,
            checked,
            sampling_params,
            timeout_seconds=max(deadline - time.monotonic(), 0.001),
            what=f"{engine.description} to generate {len(checked)} prompt(s)",
        )

        def timed_out() -> WeightSyncTimeoutError:
            return WeightSyncTimeoutError(
                f"Timed out after {timeout:g} s waiting for {call.what}. The engine may be frozen or overloaded; "
                "for longer rollouts raise timeout_seconds (generate_timeout_seconds of VLLMWeightSync)."
            )

        try:
            wait_polling(
                call.done,
                timeout=max(deadline - time.monotonic(), 0.0),
                interval=_DEATH_POLL_SECONDS,
                check=lambda: raise_if_dead(engine),
                timeout_error=timed_out,
            )
        except WeightSyncError:
            self._timed_out[engine_index] = call
            raise
        try:
            generations = call.result(0)
        except WeightSyncTimeoutError as error:  # the engine's own request ended at the deadline
            raise timed_out() from error
        except Exception as error:
            if is_engine_death(error):
                raise EngineDeadError(
                    f"{engine.description} died while generating ({type(error).__name__}: {error}). Restart it; "
                    "the next push re-joins an engine that is back."
                ) from error
            raise
        return generations

    def _engine(self, engine_index: int) -> EngineTarget:
        engines = self.updater.engines
        if not engines:
            raise RuntimeError(
                "This rank holds no vLLM engine to generate from (under DDP only global rank 0 has one unless every "
                "rank is given an engine, e.g. a server URL)."
            )
        if not 0 <= engine_index < len(engines):
            raise ValueError(f"Unknown engine_index={engine_index!r}; the engines are {list(range(len(engines)))}.")
        return engines[engine_index]

    def _await_timed_out(self, engine_index: int, engine: EngineTarget, deadline: float) -> None:
        timed_out = self._timed_out.get(engine_index)
        if timed_out is None:
            return
        if not timed_out.wait(max(deadline - time.monotonic(), 0.0)):
            raise WeightSyncTimeoutError(
                f"{engine.description} has still not finished an earlier generate that timed out: it is frozen "
                "or dead. Restart it (or wait for it) and generate again."
            )
        del self._timed_out[engine_index]

    def record(self, weight_versions: Sequence[int]) -> None:
        """Note the versions of samples about to be used; refuse them if too stale.

        Raises:
            StaleRolloutsError: one is more than ``max_staleness`` versions behind the trainer.
        """
        if not weight_versions:
            return
        oldest = min(weight_versions)
        versions = self.updater.versions
        current, missed = versions.trainer, versions.missed
        if self.max_staleness is not None and current - oldest > self.max_staleness:
            raise StaleRolloutsError(
                f"Rollouts from weight version {oldest} are {current - oldest} versions behind the trainer "
                f"(version {current}), more than max_staleness={self.max_staleness}. Push more often "
                "(every_n_train_steps), generate from the engines this callback updates, or raise max_staleness."
                + (f" {missed} push point(s) since sent no weights (failed or skipped)." if missed else "")
            )
        versions.sampled(oldest)


# Errors that cross ranks as JSON, raised again under the same type on every rank.
_RAISABLE: dict[str, type[Exception]] = {
    error.__name__: error
    for error in (TypeError, ValueError, WeightSyncTimeoutError, EngineDeadError, StaleRolloutsError, WeightSyncError)
}


def _error_record(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def _generation_from_record(record: dict[str, Any]) -> Generation:
    record["weight_versions"] = [tuple(span) for span in record["weight_versions"]]
    return Generation(**record)


class SamplesRollouts(ABC):
    """A callback whose engines :func:`generate` samples from, through its ``rollouts``;
    ``VLLMWeightSync`` declares it (its ``generate`` may push first: ``fronts/lightning/sleeping.py``)."""

    rollouts: RolloutSampler

    @abstractmethod
    def generate(
        self, prompts: Any, sampling_params: Any = None, **options: Unpack[GenerateOptions]
    ) -> list[Generation]:
        """Sample from the callback's engines (``RolloutSampler.generate`` says what it takes and returns)."""


def sampler_of(module: pl.LightningModule) -> RolloutSampler:
    """The rollout sampler of the ``VLLMWeightSync`` callback of the trainer running ``module``.

    Raises:
        RuntimeError: the module is not attached to a trainer, or the trainer has no
            such callback, or several.
    """
    return _rollouts_callback(module).rollouts


def _rollouts_callback(module: pl.LightningModule) -> SamplesRollouts:
    if module._trainer is None:
        raise RuntimeError(f"{type(module).__name__} is not attached to a Trainer: generate inside training_step.")
    # Lightning sets Trainer.callbacks per instance, so type checkers do not see it.
    callbacks = getattr(module.trainer, "callbacks", [])
    found = [callback for callback in callbacks if isinstance(callback, SamplesRollouts)]
    if len(found) != 1:
        raise RuntimeError(
            f"The Trainer has {len(found)} VLLMWeightSync callbacks; rollouts need exactly one "
            "(Trainer(callbacks=[VLLMWeightSync(engine=...)]))."
        )
    return found[0]


def generate(
    module: pl.LightningModule, prompts: Any, sampling_params: Any = None, **options: Unpack[GenerateOptions]
) -> list[Generation]:
    """Sample rollouts from inside ``training_step`` with the engine the callback keeps in sync.

    ``module`` is the LightningModule (``self`` in ``training_step``); the rest is
    :meth:`RolloutSampler.generate`'s: the prompts, vLLM ``SamplingParams`` and :class:`GenerateOptions`. Returns one
    :class:`Generation` per sample: token ids, logprobs, text, weight version.

    Example::

        >>> from vllm import SamplingParams  # doctest: +SKIP
        >>> def training_step(self, batch, batch_idx):  # doctest: +SKIP
        ...     rollouts = generate(self, batch["prompt_ids"], SamplingParams(n=8, logprobs=0))
    """
    return _rollouts_callback(module).generate(prompts, sampling_params, **options)
