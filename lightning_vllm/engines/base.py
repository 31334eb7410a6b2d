"""What the updater and rollouts need from a vLLM engine, wherever it runs.

:class:`EngineTarget` is the contract every engine target keeps. What only some can do is a capability, a small
``Protocol`` the target declares, which the core asks with ``isinstance``; nothing is asked by probing for a name.

- :class:`ServesLoraAdapters`: it generates through a LoRA adapter a push staged;
- :class:`FollowsUpdaterTimeout`: its requests have a timeout of their own, which follows the updater's;
- :class:`ChecksBackgroundPushes`: it may refuse pushes from another thread, and says so before one is made;
- :class:`GeneratesOnlyInCalls`: it generates only inside its own ``generate`` calls, so nothing needs pausing;
- :class:`ChecksIPCHandles`: it can tell, before any byte moves, whether it will take CUDA IPC handles;
- :class:`UpdatesInOneCall`: its workers start, load and finish an update in one call;
- :class:`ReportsLayerSums`: its workers sum, per layer, the weights they hold (the check after a push);
- :class:`NamesItsEngine`: it names the engine under it, so two targets of one engine are known as one.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.lora.serving import LoraLimits, PolicyAdapter
from lightning_vllm.options import PauseMode
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights


@dataclass
class Generation:
    """One sampled completion of one prompt.

    Attributes:
        prompt_token_ids: the prompt.
        token_ids: the generated tokens.
        logprobs: log-probability of each generated token, if asked for.
        prompt_logprobs: log-probability of each prompt token after the first, if asked for.
        text: the generated text, when the engine has a tokenizer.
        weight_version: the version of the weights that produced the first token (0: the
            weights the engine started with). Where the engine cannot say which version
            produced the first token and a push landed while the request ran,
            ``weight_version_exact`` is ``False`` and this is the version the engine served
            when the request was sent: never newer than the first token's, so staleness is
            never under-reported.
        weight_versions: ``(version, start, end)`` spans over ``token_ids`` when vLLM reports them.
        weight_version_exact: whether ``weight_version`` is known to be the first token's.
        partial_version: set when the engine served a mix: ``weight_version``'s weights with the layers a failed
            push of this version had loaded before it failed (vLLM's streaming ``nccl``/``ipc``: no single version
            names those weights; :func:`mixed_weight_version`). ``None``: the weights of ``weight_version``.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None = None
    prompt_logprobs: list[float] | None = None
    text: str | None = None
    weight_version: int = 0
    weight_versions: list[tuple[int, int, int]] = field(default_factory=list)
    weight_version_exact: bool = True
    partial_version: int | None = None


@runtime_checkable
class ServesLoraAdapters(Protocol):
    """Capability of an engine target: it can generate through a LoRA adapter that a push staged.

    Adapter pushes of LoRA policies (``lora="adapter"``/``"auto"``) need it; a target without it
    is sent merged weights. Every target of this package declares it through :class:`ServesAdapter`.
    """

    @property
    def adapter(self) -> PolicyAdapter | None:
        """The adapter generation goes through, ``None`` while the base model serves the policy."""
        ...

    def lora_limits(self) -> LoraLimits | None:
        """The engine's LoRA settings; ``None`` when it was built without LoRA."""
        ...

    def check_serves_adapters(self) -> None:
        """Raise ``EngineConfigError`` (saying why and how to fix it) if the engine cannot serve a pushed adapter."""
        ...

    def serve_adapter(self, adapter: PolicyAdapter | None) -> None:
        """Generate through ``adapter`` from now on (``None``: through the base model)."""
        ...

    def lora_request(self) -> Any:
        """The ``LoRARequest`` generation passes, ``None`` while the base model serves the policy."""
        ...


@runtime_checkable
class FollowsUpdaterTimeout(Protocol):
    """Capability of an engine target whose requests have a timeout of their own: it takes the
    updater's ``timeout_seconds`` when a connection opens, unless it was given one."""

    def follow_timeout(self, timeout_seconds: float) -> None: ...


@runtime_checkable
class ChecksBackgroundPushes(Protocol):
    """Capability of an engine target that may not accept pushes from a thread other than the one
    generating (``blocking=False``); targets without it always may."""

    def background_push_problem(self) -> str | None:
        """Why a push may not run on another thread than generation (``None``: it may)."""
        ...


@runtime_checkable
class GeneratesOnlyInCalls(Protocol):
    """Capability of an engine target that generates only inside its own ``generate`` calls, which it serializes
    with the calls that commit a push (an in-process ``vllm.LLM``): nothing runs between calls to pause, and a push
    makes no pause or resume call. Each would be a bounded call, a hand-off to another thread: about 0.1 ms here,
    several times that on a GPU host's busy CPU (docs/runs.md)."""

    def generates_only_in_calls(self) -> bool:
        """Whether it does now (``pause_generation`` and ``resume_generation`` then do nothing)."""
        ...


@runtime_checkable
class ChecksIPCHandles(Protocol):
    """Capability of an engine target that can tell, before any byte moves, whether it will take
    vLLM's CUDA IPC handles (the ``ipc`` backend; see ``engines/serialization.py``)."""

    def ipc_handles_problem(self) -> str | None:
        """Why ``ipc`` pushes would be refused, with the fix (``None``: they will be taken)."""
        ...


@runtime_checkable
class UpdatesInOneCall(Protocol):
    """Capability of an engine target whose workers can start, load and finish an update in one call.

    vLLM's control plane is three calls (start, update, finish), each a round trip to the engine core,
    then one more to set the version; a worker that loads while the call runs (CUDA IPC: the bytes are
    on the trainer's GPU already) can take all three in one ``collective_rpc`` of a function the backend
    gives (``backends/lightning_ipc/worker.update_in_one_call``). On an H200 each round trip cost about a
    millisecond of a push whose copy takes eight (docs/runs.md).
    """

    def update_weights_in_one_call(
        self, update_on_worker: Callable[..., None], update_info: dict[str, Any], weight_version: str | None
    ) -> None:
        """Run ``update_on_worker(worker, update_info=update_info)`` on every worker (it starts an update, loads
        and finishes it), then commit ``weight_version`` (``None``: no version)."""
        ...


@runtime_checkable
class NamesItsEngine(Protocol):
    """Capability of an engine target that names the vLLM engine under it: two targets of one engine (two updaters
    given the same ``vllm.LLM``) are one engine to what a failed push leaves running (``core/after_failure.py``).
    Seen on an H200: a second updater's group was formed while the first one's cleanup ran, whose release then tore
    down the new group on the worker."""

    def engine_key(self) -> Hashable:
        """What identifies the engine: the ``vllm.LLM`` or ``AsyncLLM`` object, the Ray actor, the server's URL."""
        ...


@runtime_checkable
class ReportsLayerSums(Protocol):
    """Capability of an engine target whose workers can sum, per layer, the weights they hold: the
    check after every push (``weights/layer_sums.py``, ``engines/worker_check.py``)."""

    def layer_sums_problem(self) -> str | None:
        """Why its workers cannot be asked, with the fix (``None``: they can)."""
        ...

    def layer_sums(self) -> list[dict[str, Any]]:
        """Each worker's report (``weights.layer_sums.held_layer_sums``)."""
        ...


class ServesAdapter(ServesLoraAdapters):
    """What every engine target of this package shares to serve a pushed LoRA adapter: it remembers
    which adapter generation goes through. Subclasses read :meth:`lora_limits` from their engine."""

    adapter: PolicyAdapter | None = None

    @abstractmethod
    def lora_limits(self) -> LoraLimits | None: ...

    def check_serves_adapters(self) -> None:
        """In-process engines and actors serve any adapter they stage: nothing to check."""

    def serve_adapter(self, adapter: PolicyAdapter | None) -> None:
        self.adapter = adapter

    def lora_request(self) -> Any:
        return self.adapter.lora_request() if self.adapter is not None else None


@runtime_checkable
class EngineTarget(Protocol):
    """The target of one vLLM engine: its facts, its weight-sync control plane, and generation.

    The four ``*_weight_*`` methods are vLLM's ``VLLMWeightSyncClient`` protocol; each
    blocks until the engine has done it (the updater bounds every call with a timeout).

    Optional capabilities are small protocols of their own, which a target declares by
    subclassing them: :class:`ServesLoraAdapters` (adapter pushes of LoRA policies),
    :class:`FollowsUpdaterTimeout`, :class:`ChecksBackgroundPushes`, :class:`ChecksIPCHandles`.

    Attributes:
        description: a short human name for messages, e.g. ``"in-process vllm.LLM"``; set once (a push names its
            engine in every bounded call's message).
    """

    description: str

    def transfer_backend(self) -> str | None:
        """The weight-transfer backend the engine was built with, ``None`` if none."""
        ...

    def device_type(self) -> str:
        """vLLM's device type: ``"cpu"``, ``"cuda"``, ..."""
        ...

    def tensor_parallel_size(self) -> int: ...

    def num_workers(self) -> int:
        """Worker processes that join the transfer group (TP x PP x DP)."""
        ...

    def expected_weights(self) -> ExpectedWeights | None:
        """What the engine's model loads (names, serving dtypes, shapes), ``None`` if unknown."""
        ...

    def is_dead(self) -> bool:
        """Whether the engine is known to have died; ``False`` when the adapter cannot tell.

        Must answer at once (it is asked while a generate is waiting)."""
        ...

    def prompt_limits(self) -> PromptLimits:
        """What the engine accepts as prompts (vocabulary, length, text); checked before each generate."""
        ...

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...

    def get_weight_version(self) -> str | None: ...

    def reset_prefix_cache(self) -> None: ...

    def pause_generation(self, mode: PauseMode) -> None:
        """Stop scheduling requests until :meth:`resume_generation` (no-op where nothing runs concurrently)."""
        ...

    def resume_generation(self) -> None: ...

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any, *, timeout_seconds: float | None = None
    ) -> list[Generation]:
        """Sample completions with vLLM ``SamplingParams``; one entry per sample, prompt by prompt.

        Prompts are token-id lists, or text when the engine has a tokenizer, already
        checked against :meth:`prompt_limits`. ``timeout_seconds`` is the longest the call
        may take (``None``: the target's own default); a target that can end its request
        at that time does (a server's HTTP request, a Ray call), the others rely on the
        caller, which bounds the wait either way.
        """
        ...


def as_prompt(prompt: list[int] | str) -> Any:
    """A vLLM prompt: ``TokensPrompt`` for token ids, the text itself otherwise."""
    if isinstance(prompt, str):
        return prompt
    from vllm import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(prompt))


def spans(weight_versions: Any) -> list[tuple[int, int, int]]:
    """vLLM's ``WeightVersionSpan`` list (or dicts from JSON) as plain tuples of ints."""
    return [
        (version_number(_span_field(span, "version")), int(_span_field(span, "start")), int(_span_field(span, "end")))
        for span in weight_versions or []
    ]


def _span_field(span: Any, field_name: str) -> str:
    return str(span[field_name] if isinstance(span, dict) else getattr(span, field_name))


def generations_from_outputs(
    outputs: Any, reported_before: tuple[int, int | None], unchanged: bool = True
) -> list[Generation]:
    """Turn vLLM ``RequestOutput`` objects into :class:`Generation` s.

    ``reported_before`` is what the engine reported (:func:`parse_weight_version`) before the request was
    sent, and ``unchanged`` whether it reported the same after the request finished: a sample for which vLLM
    reports no spans (no token generated) takes ``reported_before``, exact when no push landed (or failed) in
    between.
    """
    version_before, partial_before = reported_before
    result = []
    for output in outputs:
        prompt = list(output.prompt_token_ids or [])
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            prompt_logprobs = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        for sample in output.outputs:
            token_ids = list(sample.token_ids)
            logprobs = None
            if sample.logprobs is not None:
                logprobs = [entry[token].logprob for entry, token in zip(sample.logprobs, token_ids)]
            raw_spans = getattr(sample, "weight_versions", None) or []  # (absent before vLLM 0.32)
            versions = spans(raw_spans)
            partial = parse_weight_version(_span_field(raw_spans[0], "version"))[1] if raw_spans else partial_before
            result.append(
                Generation(
                    prompt_token_ids=prompt,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    text=sample.text or None,
                    weight_version=versions[0][0] if versions else version_before,
                    weight_versions=versions,
                    weight_version_exact=bool(versions) or unchanged,
                    partial_version=partial,
                )
            )
    return result


def version_number(weight_version: str | None) -> int:
    """A weight version string as a number; vLLM's ``"default"`` (never pushed) is 0, and a mixed state
    (:func:`mixed_weight_version`) is the version it was committed as.

    Example::

        >>> version_number("7"), version_number("default"), version_number(None), version_number("7+8")
        (7, 0, 0, 7)
    """
    return parse_weight_version(weight_version)[0]


def mixed_weight_version(committed: int, failed: int) -> str:
    """What an engine reports after a push failed half way over vLLM's streaming ``nccl``/``ipc``, which load each
    layer as it arrives and cannot roll back: ``"{committed}+{failed}"``, version ``committed``'s weights with the
    layers the failed push ``failed`` had loaded (possibly none), until the next push lands.

    Example::

        >>> mixed_weight_version(3, 4), parse_weight_version(mixed_weight_version(3, 4))
        ('3+4', (3, 4))
    """
    return f"{committed}+{failed}"


def parse_weight_version(weight_version: str | None) -> tuple[int, int | None]:
    """``(version, partial version)`` of what an engine reports (:func:`mixed_weight_version`); ``None``: not mixed.

    Example::

        >>> parse_weight_version("7"), parse_weight_version("default"), parse_weight_version("7+8")
        ((7, None), (0, None), (7, 8))
    """
    committed, mixed, failed = (weight_version or "").partition("+")
    return int(committed) if committed.isdigit() else 0, int(failed) if mixed and failed.isdigit() else None
