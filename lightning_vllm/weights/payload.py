"""What one push carries: the tensors, and what travels beside them, whole (:class:`Payload`) and as sent to one
engine (:class:`Outgoing`).

A push is chosen once (``core/payload_choice.py``) and then handed down unchanged:
the connection checks it against each engine, a background push copies its tensors
(``weights/snapshot.py``) and a sharded push walks them in lockstep
(``fronts/lightning/roles.LockstepWeights``), each replacing ``weights`` only. Whatever else the
engine needs (the LoRA adapter's config, what each tensor was computed from, the other trainer ranks sending their
shares alongside) stays in the :class:`Payload`, so no wrapper of the weights, and no layer between the front end and
the backend, must remember to forward it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from lightning_vllm.weights.base import Stamp, Weights
from lightning_vllm.weights.shares import EveryRankSend

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
