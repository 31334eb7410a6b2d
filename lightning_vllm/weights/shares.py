"""What each trainer rank sends of a sharded policy when every rank sends (``push_from="every_rank"``).

With FSDP2 each rank holds rows ``[k * c, (k + 1) * c)`` of every parameter (``c`` is the
first dimension divided by the number of ranks, rounded up: ``torch.chunk``'s rule), which
in row-major order is one run of the full tensor's bytes. So rank ``k`` can send its local
shard as it is, no gather, and the shares of all ranks, laid end to end in rank order, are
the full tensor: the workers put each where it belongs (``transports/gloo/receiver.py``).
A parameter every rank holds whole (replicated, or not a DTensor) is split the same way
over its flattened elements. Every rank computes every rank's counts from the parameter's
global shape alone, so rank 0 can tell the workers what to expect from each rank.

Anything else (FSDP1 flat parameters, ZeRO-3 partitions, a 2-D mesh, ``Shard(1)``, a LoRA
policy, whose merged weights are computed from several tensors) has no such share: the
push then gathers on every rank and rank 0 sends (``ranks.LockstepWeights``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.sources import ModuleWeights


def chunk_counts(length: int, world_size: int) -> list[int]:
    """How many of ``length`` items each of ``world_size`` ranks holds under ``torch.chunk``'s rule.

    Example::

        >>> chunk_counts(10, 4)
        [3, 3, 3, 1]
        >>> chunk_counts(2, 4)
        [1, 1, 0, 0]
    """
    size = -(-length // world_size) if length else 0
    return [max(0, min(size, length - rank * size)) for rank in range(world_size)]


def share_counts(param: torch.Tensor, world_size: int) -> list[int] | str:
    """The elements of ``param`` (in row-major order) each rank sends, in rank order, or why it has no share.

    Example::

        >>> share_counts(torch.zeros(5, 2), 2)  # a tensor every rank holds whole
        [5, 5]
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return chunk_counts(param.numel(), world_size)
    mesh = param.device_mesh
    if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != list(range(world_size)):
        return f"its device mesh {mesh.mesh.tolist()} is not one dimension over every rank in order"
    placement = param.placements[0]
    if isinstance(placement, Replicate):
        return chunk_counts(param.numel(), world_size)
    if isinstance(placement, Shard) and placement.dim == 0 and param.dim() > 0:
        per_row = param.numel() // param.shape[0] if param.shape[0] else 0
        return [rows * per_row for rows in chunk_counts(param.shape[0], world_size)]
    return f"it is placed as {placement}, not Shard(0)"


def local_share(param: torch.Tensor, rank: int, counts: Sequence[int]) -> torch.Tensor:
    """This rank's share of ``param`` as a flat tensor (a view of its own memory, nothing gathered).

    Raises:
        ValueError: the local shard does not hold the elements ``counts`` gives this rank.
    """
    from torch.distributed.tensor import DTensor, Shard

    data = param.detach()
    if isinstance(data, DTensor):
        local = data.to_local()
        if isinstance(data.placements[0], Shard):
            if local.numel() != counts[rank]:
                raise ValueError(
                    f"rank {rank} holds {local.numel()} elements of a {tuple(data.shape)} parameter where "
                    f"torch.chunk's rule gives it {counts[rank]}; push with push_from='rank0'."
                )
            return local.reshape(-1)
        data = local
    begin = sum(counts[:rank])
    return data.reshape(-1)[begin : begin + counts[rank]]


class RankShares(Weights):
    """One rank's share of every tensor of a policy: ``(name, flat share)`` in the source's order.

    Declares the full tensors (names, dtypes, global shapes), like the source, so the
    engine's checks see the whole policy; :meth:`counts` says how the full tensor is split.

    Args:
        source: the policy's weights (an FSDP2 model, or one every rank holds whole).
        rank: this trainer rank.
        world_size: how many trainer ranks send.

    Example::

        >>> from lightning_vllm.weights.sources import ModuleWeights
        >>> shares = RankShares(ModuleWeights(torch.nn.Linear(3, 2)), rank=1, world_size=2)
        >>> shares.counts("weight"), [tuple(piece.shape) for _, piece in shares.iter_full()]
        ([3, 3], [(3,), (1,)])
    """

    def __init__(self, source: ModuleWeights, rank: int, world_size: int) -> None:
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self._counts: dict[str, list[int]] = {}
        for name, param in source.named_parameters():
            counts = share_counts(param, world_size)
            if isinstance(counts, str):
                raise ValueError(f"{name!r} has no share of its own on each rank: {counts}.")
            self._counts[name] = counts

    @classmethod
    def of(cls, source: Weights, rank: int, world_size: int) -> RankShares | str:
        """This rank's shares of ``source``, or why it cannot be sent in shares."""
        if type(source) is not ModuleWeights:  # a LoRA merge or an FSDP1/ZeRO-3 source: computed or gathered
            return f"a {type(source).__name__} is not sent in shares (only a plain or FSDP2 model is)"
        try:
            return cls(source, rank, world_size)
        except ValueError as error:
            return str(error)

    def counts(self, name: str) -> list[int]:
        """How many elements of tensor ``name`` each rank sends, in rank order."""
        return self._counts[name]

    def declare(self) -> list[ParamMeta]:
        return self.source.declare()

    def groups(self) -> list[list[str]]:
        return self.source.groups()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, this rank's flat share)``; not the full tensors despite the name (see the class)."""
        for name, param in self.source.named_parameters():
            yield name, local_share(param, self.rank, self._counts[name])


class EveryRankSend(ABC):
    """Rank 0's side of a push every trainer rank sends a share of, as the transport sees it.

    For each engine, the transport tells the other ranks what this pass carries
    (:meth:`begin_pass`), sends rank 0's shares while they send theirs, and hears from
    them once the bytes have moved (:meth:`end_pass`), before the engine commits.
    ``ranks.py`` implements it on the trainer's status group.
    """

    shares: RankShares

    @property
    @abstractmethod
    def senders(self) -> list[dict[str, Any]]:
        """Where the workers reach trainer ranks 1, 2, ...: ``{"address", "port"}`` each."""

    @abstractmethod
    def begin_pass(self, group: str, num_workers: int, wire: Sequence[tuple[str, torch.dtype]]) -> None:
        """Tell the other ranks to accept ``num_workers`` workers naming ``group``, then send their
        shares of the tensors of ``wire`` (names and wire dtypes, in send order)."""

    @abstractmethod
    def end_pass(self, error: BaseException | None) -> None:
        """Hear whether every rank sent its shares (``error``: rank 0's failure, told to the others).

        Raises:
            WeightSyncError: another rank failed (only when ``error`` is ``None``).
        """
