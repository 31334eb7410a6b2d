"""The core: the engines, the versions, the options and the post hooks of one trainer's pushes.

:class:`WeightSync` knows no framework. The Lightning front end (``fronts/lightning/``: the callback, its rank roles,
background pushes, rollouts) and TorchRL's ``VLLMUpdater`` (``fronts/torchrl/``) are two front ends on top of it,
side by side. A push is prepared
(:meth:`WeightSync.prepare`: what to send, to which engines, every check), then sent and
committed (:meth:`WeightSync.send`, which runs the post hooks), inside one push point's handle on the versions
(``versions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_vllm._waits import call_with_timeout
from lightning_vllm.backends.registry import check_requested
from lightning_vllm.core.connection import EngineConnection
from lightning_vllm.core.facts import EngineFacts
from lightning_vllm.core.payload_choice import choose_view, needs_facts, payload_for, policy_of
from lightning_vllm.core.push import EngineSelection, EngineSet, Push, SyncStats
from lightning_vllm.core.versions import InFlight, PushPointVersions, WeightVersions
from lightning_vllm.engines import EngineTarget, as_engine_targets
from lightning_vllm.engines.base import ServesLoraAdapters
from lightning_vllm.errors import EngineConfigError, WeightsMismatchError
from lightning_vllm.options import UpdaterOptions, check_updater_options
from lightning_vllm.weights import ModelMetadata, source_metadata, weights_from
from lightning_vllm.weights.model import as_metadata
from lightning_vllm.weights.payload import KeptChoice, Payload, PushView
from lightning_vllm.weights.survey import Surveys

_OPTION_NAMES = frozenset(field.name for field in fields(UpdaterOptions))


def refuse_option_attribute(owner: object, name: str) -> None:
    """Raise if ``name`` is one of the options, which ``owner`` keeps once, in ``owner.options``: set as an
    attribute it would be a stray one no push reads.

    Raises:
        AttributeError: it is (says how to change it).
    """
    if name in _OPTION_NAMES:
        raise AttributeError(
            f"{name} is one of the options, stored once in {type(owner).__name__}.options: "
            f"call set_options({name}=...) to change it."
        )


NO_WEIGHTS = (
    "A push needs the weights: pass the policy (a Hugging Face model or a LightningModule holding one), "
    "a dict of tensors or a TensorDict. This updater does not fetch weights by itself."
)


@runtime_checkable
class HoldsWeightSync(Protocol):
    """A front end that has a core (TorchRL's ``VLLMUpdater``): another front end (the Lightning callback) pushes
    through the same core, so both count the same versions and run the same post hooks."""

    weight_sync: WeightSync


class WeightSync:
    """Pushes a policy's weights into vLLM engines over vLLM's weight-transfer protocol, and counts versions.

    For each engine it joins one collective group with its workers (trainer rank 0, then
    every worker; one group per engine, so engines fail and are updated independently),
    checks before any byte moves that the engine is set up for the chosen backend and that
    the weights fit the engine's model (names, shapes, dtypes, read from the checkpoint the
    engine loaded), converts them to the engine's serving dtype on the way, and after each
    successful push commits a new weight version in the engine and resets its prefix cache,
    so no rollout reuses KV computed with old weights.

    Args:
        engine: the vLLM engine(s) to update: a ``vllm.LLM``, an ``AsyncLLM``, a server URL
            (``"http://host:port"``), a Ray actor handle of ``VLLMActor``, any ``EngineTarget``,
            or a list mixing them (their indices are list positions).
        options: how it connects and sends (``UpdaterOptions``; ``VLLMUpdater`` documents each).
        model_metadata: ``{name: (dtype, shape)}`` of the weights to send, dtypes being the
            engine's serving dtypes; taken from the first pushed weights when ``None``.

    Example::

        >>> from vllm import LLM  # doctest: +SKIP
        >>> llm = LLM(model=path, dtype="float32", weight_transfer_config={"backend": "gloo"})  # doctest: +SKIP
        >>> sync = WeightSync(engine=llm)  # doctest: +SKIP
        >>> sync.push(hf_model).weight_version, llm.get_weight_version()  # doctest: +SKIP
        (1, '1')
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        options: UpdaterOptions | None = None,
        model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None = None,
    ) -> None:
        self._options = options or UpdaterOptions()
        targets = as_engine_targets(engine) if engine is not None else []
        check_updater_options(self._options, num_engines=len(targets))  # before anything is used
        check_requested(self._options.backend)
        self._engine_set = EngineSet(targets)
        self.model_metadata: ModelMetadata | None = as_metadata(model_metadata)
        self.versions = WeightVersions()
        self._post_hooks: list[Callable[[], Any]] = []
        self.last_sync: SyncStats | None = None
        self._kept: KeptChoice | None = None  # the last push's choice and checks, for the next push of its model
        self._adapter_consumer_problems: list[str] = []  # (set_adapter_consumer_problems)

    @property
    def options(self) -> UpdaterOptions:
        """The settings this pushes with, stored here only (change them with :meth:`set_options`)."""
        return self._options

    def set_options(self, **changes: Any) -> None:
        """Push with ``changes`` to the options from now on (``set_options(lora="merged")``), checked as
        the constructor checks them. The groups formed are left (the next push joins again with them).

        Raises:
            ValueError: an option out of range, or a name that is not an option.
        """
        if unknown := sorted(set(changes) - _OPTION_NAMES):
            known = ", ".join(sorted(_OPTION_NAMES))
            raise ValueError(f"Not an option: {', '.join(unknown)}. The options are {known}.")
        options = replace(self._options, **changes)
        check_updater_options(options, num_engines=len(self._engine_set))
        check_requested(options.backend)
        self.close()
        self._options = options

    def set_adapter_consumer_problems(self, problems: list[str]) -> None:
        """Why something outside this package that samples from the engines could not sample from a pushed LoRA
        adapter (said by the front end that knows it: TorchRL's, of its collector's policy); ``lora="auto"`` then
        pushes merged weights. The next push chooses its payload anew (a kept choice may have sent the adapter)."""
        self._adapter_consumer_problems = list(problems)
        self._kept = None

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_option_attribute(self, name)
        super().__setattr__(name, value)

    # -- engines and groups -----------------------------------------------------

    @property
    def engine(self) -> EngineTarget | None:
        """The target of the first engine (the only one, usually)."""
        return self._engine_set.targets[0] if self._engine_set.targets else None

    @property
    def engines(self) -> list[EngineTarget]:
        """The targets of every engine, in index order."""
        return list(self._engine_set.targets)

    def set_engine(self, engine: Any) -> None:
        """Replace the engine(s) this pushes to (leaving any group formed with the old ones)."""
        targets = as_engine_targets(engine) if engine is not None else []
        check_updater_options(self._options, num_engines=len(targets))
        self.close()
        self._engine_set = EngineSet(targets)

    @property
    def initialized(self) -> bool:
        """Whether a group is formed with every engine."""
        return bool(self._engine_set) and len(self._engine_set.connections) == len(self._engine_set)

    def engine_indices(self) -> list[int]:
        """The indices of the engines this can push to: their positions in ``engine``."""
        return self._engine_set.indices()

    def engine_versions(self) -> dict[int, str | None]:
        """The weight version each engine reports, by index."""
        return {
            index: call_with_timeout(
                engine.get_weight_version, timeout=self._options.timeout_seconds, what="the engine's version"
            )
            for index, engine in enumerate(self._engine_set.targets)
        }

    def connect(self, model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None = None) -> None:
        """Check the metadata against each engine's model and join a group with each engine's workers.

        Blocks until every worker has joined, at most ``timeout_seconds`` per engine.

        Args:
            model_metadata: ``{name: (dtype, shape)}`` of the weights to send; replaces the
                constructor's value when given.

        Raises:
            EngineConfigError: no engine, an engine without a weight-transfer config, a
                different backend, or a tensor-parallel size that does not match.
            WeightsMismatchError: the metadata does not fit an engine's model.
            WeightSyncTimeoutError: the workers did not join in time.
        """
        if model_metadata is not None:
            self.model_metadata = as_metadata(model_metadata)
        if self.model_metadata is None:
            raise ValueError(
                "Connecting needs the model metadata: pass init(VLLMUpdater.get_model_metadata(model)) or "
                "model_metadata=... to the constructor."
            )
        self._require_engines()
        self.close()
        for index in self._engine_set.indices():
            self._follow(self._engine_set.open(index, self.model_metadata, self._options))

    def _require_engines(self) -> None:
        if not self._engine_set.targets:
            raise EngineConfigError("No vLLM engine to push to: pass engine=... (e.g. a vllm.LLM) to VLLMUpdater.")

    def _connected(self, indices: list[int]) -> tuple[dict[int, EngineConnection], dict[int, BaseException]]:
        """``EngineSet.connected`` for this updater's metadata and options, the versions following the engines'."""
        assert self.model_metadata is not None, "set by connect or by the first push"
        connections, unreachable = self._engine_set.connected(indices, self.model_metadata, self._options)
        for connection in connections.values():
            self._follow(connection)
        return connections, unreachable

    def _follow(self, connection: EngineConnection) -> None:
        # An earlier trainer (or run) may have pushed further: a version never names two sets of weights.
        self.versions.follow(connection.committed_version)

    def close(self) -> None:
        """Leave every group and release the engines' side of them; the engines keep serving."""
        self._kept = None
        self._engine_set.close()

    # -- versions and hooks ------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version of the weights last pushed (0 before the first push); see ``versions``."""
        return self.versions.committed

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self.versions.set_committed(value)

    def register_post_hook(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` after every push that commits a version, in registration order; never after one
        that no engine took."""
        if not callable(hook):
            raise TypeError(f"A post hook must be callable, got {type(hook).__name__}.")
        self._post_hooks.append(hook)

    @property
    def post_hooks(self) -> list[Callable[[], Any]]:
        """The hooks run after each push that commits a version."""
        return list(self._post_hooks)

    def send(self, push: Push, in_flight: InFlight) -> SyncStats:
        """Send a prepared push (:meth:`prepare`), ending the version ``in_flight``; once every engine that committed it
        holds what was sent, the post hooks run (before a push that failed on some engines raises).

        Raises:
            LandedWeightsMismatchError, PartialPushError, WeightSyncError: as :meth:`push`.
        """
        sent = push.send(in_flight)
        if not sent.mismatched:
            self.last_sync = sent.stats
            for hook in self._post_hooks:
                hook()
        sent.raise_failures()
        return sent.stats

    # -- pushing ----------------------------------------------------------------

    def push(
        self,
        weights: Any,
        engines: EngineSelection = None,
        point: PushPointVersions | None = None,
    ) -> SyncStats:
        """Send ``weights`` to vLLM and commit them as a new version.

        Joins the groups first if :meth:`connect` has not run (metadata then comes from the
        weights). Every engine is tried; an engine whose push fails is disconnected and joined
        again at the next push, so an engine that restarted is picked up. The version is
        committed once any engine has it (see :meth:`Push.send <lightning_vllm.core.push.Push.send>`).

        Args:
            weights: a Hugging Face or PEFT model, a LightningModule holding one, a dict of tensors
                or a TensorDict (nested keys joined with ``"."``), or a payload already chosen (one that every
                trainer rank sends a share of: ``Payload.every_rank``).
            engines: engines to update, by index or by device (the engines on that device type);
                all when ``None``.
            point: the push point's handle on the versions, when the caller opened it (a push
                every trainer rank takes part in); one of its own otherwise.

        Raises:
            WeightsMismatchError: the weights do not fit an engine's model; nothing is sent.
            PartialPushError: some engines took the push, some did not.
            WeightSyncError: no engine took it; every engine keeps its previous version.
        """
        if point is None:
            with self.versions.push_point() as point:
                return self.push(weights, engines, point)
        return self.send(self.prepare(weights, engines), point.begin())

    def prepare(self, weights: Any, engines: EngineSelection = None) -> Push:
        """Everything of :meth:`push` before the first byte moves: what to send, to which engines
        (joining their groups if needed), and every check. ``Push.send`` sends it.

        Raises:
            WeightsMismatchError, EngineConfigError: as :meth:`push`; nothing was sent.
        """
        if weights is None:
            raise ValueError(NO_WEIGHTS)
        self._require_engines()
        targets = self._engine_set.resolve(engines)
        # (Asked once: an engine that cannot be reached must not be waited for twice.)
        reached: tuple[dict[int, EngineConnection], dict[int, BaseException]] | None = None
        if self._kept is not None:  # the same model as last time, unchanged: the same choice, checked already
            reached = connections, unreachable = self._connected(targets)
            kept = self._kept.kept_payload(weights, connections, unreachable, self._options.changed_only)
            if kept is not None:
                return Push(kept, connections, unreachable, self._engine_set)
            self._kept = None
        surveys = Surveys()
        payload = self.choose_payload(weights, targets, surveys=surveys)
        offered = source_metadata(payload.weights)
        derived = self.model_metadata is None
        if derived:  # (an adapter view set it from the merged weights)
            self.model_metadata = offered
        try:
            connections, unreachable = reached or self._connected(targets)
        except WeightsMismatchError:
            if derived:  # a model the engines refused is not what the next push's groups are formed for
                self.model_metadata = None
            raise
        for connection in connections.values():  # every check before the first byte moves
            connection.check(payload, offered)
        self._kept = KeptChoice.of(weights, surveys.made(weights), payload, connections, unreachable)
        return Push(payload, connections, unreachable, self._engine_set)

    # -- what a push carries ------------------------------------------------------

    def engine_facts(self, engines: EngineSelection = None) -> dict[int, EngineFacts]:
        """Connect, as an explicit step: join the groups of the engines ``engines`` names that are not
        formed yet, and return what each connected one tells a push's choice (``core/facts.py``), by
        index. The engines not reached now are left out (a push still goes to the others).

        Raises:
            EngineConfigError, WeightsMismatchError: an engine is misconfigured (no retry fixes that).
            WeightSyncError: no engine can be reached.
        """
        self._require_engines()
        connections, _ = self._connected(self._engine_set.resolve(engines))
        return {index: connection.facts() for index, connection in connections.items()}

    def choose_view(self, weights: Any, engines: EngineSelection = None, surveys: Surveys | None = None) -> PushView:
        """How a push of ``weights`` sends the policy (``core/payload_choice.py``): its full (merged) weights, its
        LoRA adapter alone, or the base weights with the adapter. A LoRA policy's choice reads the engines' facts,
        connecting to them first (:meth:`engine_facts`). A sharded push decides it on one rank and hands it to every
        rank's :meth:`choose_payload`, which raises as it does (given the same ``surveys``, both walk the modules once).
        """
        if isinstance(weights, Payload):
            return weights.view
        return self._decided_view(weights, policy_of(weights, self._options, surveys or Surveys()), engines)

    def choose_payload(
        self,
        weights: Any,
        engines: EngineSelection = None,
        view: PushView | None = None,
        surveys: Surveys | None = None,
    ) -> Payload:
        """What a push of ``weights`` carries (``core/payload_choice.py``): its tensors, its LoRA adapter and its
        stamps, chosen once, sent as ``view`` (decided here, :meth:`choose_view`, when not given).
        ``surveys``: the push's surveys of the policy's modules (each walked once).

        Raises:
            EngineConfigError: ``lora="adapter"`` but an engine cannot serve the adapter (says why).
            ValueError: ``lora="adapter"`` but ``weights`` is not a PEFT LoRA policy sent from a
                plain, DDP or FSDP2 module.
        """
        if isinstance(weights, Payload):  # chosen already (a push every trainer rank takes part in)
            return weights
        surveys = surveys or Surveys()  # each module of the policy walked once
        policy = policy_of(weights, self._options, surveys)
        chosen = view if view is not None else self._decided_view(weights, policy, engines)
        return payload_for(weights, policy, chosen, self._options, surveys)

    def _decided_view(self, weights: Any, policy: torch.nn.Module | None, engines: EngineSelection) -> PushView:
        facts: list[EngineFacts] = []
        if needs_facts(policy, self._options):
            if self.model_metadata is None:  # what the groups are formed for
                self.model_metadata = source_metadata(weights_from(weights, self._options.model_attribute))
            facts = list(self.engine_facts(engines).values())
        return choose_view(weights, policy, self._options, facts, self._adapter_consumer_problems)

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to pass to ``llm.generate`` to sample from the policy's adapter
        (``None`` before an adapter push, and when merged weights are pushed)."""
        engine = self.engine
        return engine.lora_request() if isinstance(engine, ServesLoraAdapters) else None
