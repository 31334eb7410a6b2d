"""What one push carries: the tensors, and what travels beside them, whole (:class:`Payload`) and as sent to one
engine (:class:`Outgoing`); and what a push of a model carried, kept for its next push (:class:`KeptChoice`).

A push is chosen once (``core/payload_choice.py``) and then handed down unchanged:
the connection checks it against each engine, a background push copies its tensors
(``weights/snapshot.py``) and a sharded push walks them in lockstep
(``fronts/lightning/roles.LockstepWeights``), each replacing ``weights`` only. Whatever else the
engine needs (the LoRA adapter's config, what each tensor was computed from, the other trainer ranks sending their
shares alongside) stays in the :class:`Payload`, so no wrapper of the weights, and no layer between the front end and
the backend, must remember to forward it.

A push's choice of what it sends, and its checks, are kept for the next push of the same model while they hold
(:class:`KeptChoice`). Choosing what a push of a model sends and checking it against every engine reads the model's
whole module tree, its names, dtypes and shapes: on the H200 host's CPU that was 5 ms of a colocated 8B push whose
copy takes 8.4 ms (docs/runs.md). After an optimizer step the next push of the same model would find the same, and
the choice is kept for that push, as long as

- the same object is pushed, with no other trainer rank, to the same engines over the same
  connections (a connection opened again is checked again);
- its module tree is as it was surveyed (:class:`TreeShape`): no module or parameter added,
  removed or replaced, no parameter of another dtype or shape;
- what it sends is a plain model's parameters (``ModuleWeights``), as they are or in the model's checkpoint layout
  (``CheckpointWeights``: a MoE model's plan is kept with it): LoRA policies, FSDP1 and ZeRO-3 models, dicts and
  ready sources are chosen at every push.

It holds the model and its parameters weakly, so a model pushed once and dropped is freed; changing
the options or the engines drops it (``WeightSync.close``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights.base import Stamp, Weights
from lightning_vllm.weights.checkpoint_layout import CheckpointWeights, LayoutPlan
from lightning_vllm.weights.shares import EveryRankSend
from lightning_vllm.weights.sources import ModuleWeights
from lightning_vllm.weights.survey import Survey

PushView = Literal["merged", "adapter", "base_and_adapter"]
"""What a push of a policy sends: its full weights (a LoRA policy's merged), its LoRA adapter
alone, or the base weights with the adapter (the first adapter push of a connection)."""


@dataclass(frozen=True)
class Payload:
    """What one push carries.

    Attributes:
        weights: the tensors, streamed in layer groups.
        view: how they were chosen from the policy (see :data:`PushView`).
        adapter_config: the PEFT config of the LoRA adapter among the tensors (``"adapter"`` and
            ``"base_and_adapter"`` views); vLLM's loader needs rank, alpha and target modules.
        stamps: what each tensor was computed from when the push was prepared
            (``weights/base.py``), for changed-only pushes; ``None``: every tensor counts as changed.
        every_rank: the other trainer ranks, when each sends its own share of every tensor (``weights`` then
            yields this rank's shares; ``fronts/lightning/every_rank.py``); ``None``: this rank sends it all.

    Example::

        >>> import torch
        >>> from lightning_vllm.weights import MappingWeights
        >>> payload = Payload(MappingWeights({"w": torch.ones(2)}))
        >>> payload.view, payload.carries_adapter
        ('merged', False)
    """

    weights: Weights
    view: PushView = "merged"
    adapter_config: dict[str, Any] | None = None
    stamps: dict[str, Stamp] | None = None
    every_rank: EveryRankSend | None = None

    @property
    def carries_adapter(self) -> bool:
        """Whether the tensors include a LoRA adapter the engine is to serve."""
        return self.adapter_config is not None

    def with_weights(self, weights: Weights) -> Payload:
        """The same push, its tensors read from ``weights`` (a copy, a lockstep walk) with the same metadata."""
        return replace(self, weights=weights)


@dataclass(frozen=True)
class Outgoing:
    """One push as one engine's sender sends it (``backends/base.Sender.send``): the payload under the engine's
    names, with the engine's client.

    Attributes:
        weights: the tensors, under the engine's names and serving dtypes.
        client: the engine's control plane for this push; its ``finish_weight_update`` commits the version.
        adapter: the LoRA adapter among the tensors, as the workers are told (``carries_adapters``).
        every_rank: the other trainer ranks sending their shares at the same time (``carries_shares``).
        what: the transfer, as errors name it.
        checked: the push is checked once it commits (``verify_pushes``): a worker that fingerprints what it loads
            for the check (vLLM's CPU build packs, ``packed_sums.py``) does so; an unchecked push spares that read.
    """

    weights: Weights
    client: Any
    adapter: dict[str, Any] | None = None
    every_rank: EveryRankSend | None = None
    what: str = "the transfer"
    checked: bool = True


class TreeShape:
    """A module tree as a survey found it (:meth:`of` its modules): each module with its children and its parameters
    by name, each the very object found (held weakly: this keeps nothing alive), a parameter with its dtype and shape.

    :meth:`holds` tells, without walking the tree again, whether it is still exactly so: no module or parameter
    added, removed or replaced, by ``setattr`` or in the modules' dicts directly, and no parameter's data swapped
    for another dtype or shape. An 8B model's check costs about a tenth of its survey (docs/runs.md).
    """

    def __init__(self) -> None:
        # (module, its children by name, its parameters by name with their dtypes and shapes)
        self._modules: list[tuple[weakref.ref, list[tuple[str, Any]], list[tuple[str, Any, Any, Any]]]] = []

    @classmethod
    def of(cls, modules: list[torch.nn.Module]) -> TreeShape:
        """The shape of the tree whose every module is in ``modules`` (``Survey.modules``)."""
        shape = cls()
        for module in modules:
            shape.add(module)
        return shape

    def add(self, module: torch.nn.Module) -> None:
        children = [(name, _weak(child)) for name, child in module._modules.items()]
        parameters = [
            (name, _weak(param), None if param is None else param.dtype, None if param is None else param.shape)
            for name, param in module._parameters.items()
        ]
        self._modules.append((weakref.ref(module), children, parameters))

    def holds(self) -> bool:
        """Whether every module, child and parameter is still the one found, each parameter of the same dtype and
        shape, and none was added."""
        for module_ref, children, parameters in self._modules:
            module = module_ref()
            if module is None or len(module._modules) != len(children) or len(module._parameters) != len(parameters):
                return False
            for name, child in children:
                if module._modules.get(name, _MISSING) is not _strong(child):
                    return False
            for name, param_ref, dtype, shape in parameters:
                param = module._parameters.get(name, _MISSING)
                if param is not _strong(param_ref) or (
                    param is not None and (param.dtype != dtype or param.shape != shape)
                ):
                    return False
        return True


_MISSING = object()


def _weak(value: Any) -> Any:
    return None if value is None else weakref.ref(value)


def _strong(reference: Any) -> Any:
    return None if reference is None else reference()


@dataclass(frozen=True)
class KeptChoice:
    """What a push of ``pushed`` sent and to which connections it was checked, kept for its next push.

    Build it with :meth:`of`; :meth:`kept_payload` gives the next push's payload while it holds.
    """

    pushed: weakref.ref[Any]
    shape: TreeShape
    model: weakref.ref[Any]
    parameters: tuple[tuple[str, weakref.ref[Any]], ...]
    declared: list[ParamMeta]  # the parameters' metadata (names, dtypes, shapes: no tensor)
    checked: tuple[tuple[int, object], ...]  # the connections it was checked to, compared by identity only
    plan: LayoutPlan | None = None  # how they go in the checkpoint's layout (None: as they are)

    @classmethod
    def of(
        cls,
        pushed: Any,
        survey: Survey | None,
        payload: Payload,
        connections: Mapping[int, object],
        unreachable: Mapping[int, BaseException],
    ) -> KeptChoice | None:
        """The choice of a push that passed its checks, kept if it may be (see the module docstring); else ``None``.

        ``survey``: the survey of ``pushed`` itself (the root of what was walked).
        """
        source, plan = payload.weights, None
        if isinstance(source, CheckpointWeights):
            plan = source.plan
            source = source.source
        if (
            payload.every_rank is not None
            or unreachable
            or survey is None
            or not survey.modules
            or payload.view != "merged"
            or type(source) is not ModuleWeights
        ):
            return None
        return cls(
            pushed=weakref.ref(pushed),
            shape=TreeShape.of(survey.modules),
            model=weakref.ref(source.module),
            parameters=tuple((name, weakref.ref(param)) for name, param in source.named_parameters()),
            declared=source.metadata,
            checked=tuple(connections.items()),
            plan=plan,
        )

    def kept_payload(
        self,
        pushed: Any,
        connections: Mapping[int, object],
        unreachable: Mapping[int, BaseException],
        with_stamps: bool,
    ) -> Payload | None:
        """The payload of a push of ``pushed`` to ``connections`` (its stamps read anew if ``with_stamps``), or
        ``None``: the choice no longer holds, and the push chooses and checks anew."""
        if pushed is not self.pushed() or unreachable:  # (every rank's shares are pushed as a payload: never kept)
            return None
        if len(connections) != len(self.checked) or any(connections.get(i) is not c for i, c in self.checked):
            return None
        if not self.shape.holds():
            return None
        model = self.model()
        parameters = [(name, param()) for name, param in self.parameters]
        if model is None or any(param is None for _, param in parameters):
            return None
        parameters_source = ModuleWeights(model, parameters, declared=self.declared)  # type: ignore[arg-type]
        source = parameters_source if self.plan is None else CheckpointWeights(parameters_source, self.plan)
        return Payload(source, "merged", stamps=source.stamps() if with_stamps else None)
