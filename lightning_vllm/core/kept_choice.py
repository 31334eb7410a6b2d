"""A push's choice of what it sends, and its checks, kept for the next push of the same model while they hold.

Choosing what a push of a model sends and checking it against every engine reads the model's whole
module tree, its names, dtypes and shapes: on the H200 host's CPU that was 5 ms of a colocated 8B
push whose copy takes 8.4 ms (docs/gpu.md). After an optimizer step the next push of the same model
would find the same, and :class:`KeptChoice` keeps it for that push, as long as

- the same object is pushed, with no other trainer rank, to the same engines over the same
  connections (a connection opened again is checked again);
- its module tree is as it was surveyed (``weights/survey.TreeShape``): no module or parameter added,
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
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.core.connection import EngineConnection
from lightning_vllm.weights.checkpoint_layout import CheckpointWeights, LayoutPlan
from lightning_vllm.weights.payload import Payload
from lightning_vllm.weights.sources import ModuleWeights
from lightning_vllm.weights.survey import Survey, TreeShape


@dataclass(frozen=True)
class KeptChoice:
    """What a push of ``pushed`` sent and to which connections it was checked, kept for its next push.

    Build it with :meth:`of`; :meth:`payload_for` gives the next push's payload while it holds.
    """

    pushed: weakref.ref[Any]
    shape: TreeShape
    model: weakref.ref[Any]
    parameters: tuple[tuple[str, weakref.ref[Any]], ...]
    declared: list[ParamMeta]  # the parameters' metadata (names, dtypes, shapes: no tensor)
    checked: tuple[tuple[int, EngineConnection], ...]
    plan: LayoutPlan | None = None  # how they go in the checkpoint's layout (None: as they are)

    @classmethod
    def of(
        cls,
        pushed: Any,
        survey: Survey | None,
        payload: Payload,
        connections: Mapping[int, EngineConnection],
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
            or survey.shape is None
            or payload.view != "merged"
            or type(source) is not ModuleWeights
        ):
            return None
        return cls(
            pushed=weakref.ref(pushed),
            shape=survey.shape,
            model=weakref.ref(source.module),
            parameters=tuple((name, weakref.ref(param)) for name, param in source.named_parameters()),
            declared=source.metadata,
            checked=tuple(connections.items()),
            plan=plan,
        )

    def payload_for(
        self,
        pushed: Any,
        connections: Mapping[int, EngineConnection],
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
