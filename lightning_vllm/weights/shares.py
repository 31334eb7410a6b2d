"""What each trainer rank sends of a sharded policy when every rank sends (``push_from="every_rank"``).

With FSDP2 each rank holds rows ``[k * c, (k + 1) * c)`` of every parameter (``c`` is the
first dimension divided by the number of ranks, rounded up: ``torch.chunk``'s rule), which
in row-major order is one run of the full tensor's bytes. So rank ``k`` can send its local
shard as it is, no gather, and the shares of all ranks, laid end to end in rank order, are
the full tensor: the workers put each where it belongs (``backends/gloo/receiver.py``).
A parameter every rank holds whole (replicated, or not a DTensor) is split the same way
over its flattened elements. Every rank computes every rank's counts from the parameter's
global shape alone, so rank 0 can tell the workers what to expect from each rank.

A model that transformers holds in another layout than its checkpoint's (a Mixture-of-Experts
model's experts fused over the expert index, ``weights/checkpoint_layout.py``) is sent in the
checkpoint's tensors, which are views of the fused ones: expert ``i``'s ``gate_proj`` is one run
of ``gate_up_proj``'s bytes. A rank's share of such a tensor is where that run meets the rows the
rank holds: FSDP2 shards the fused tensor by expert (``Shard(0)``), so each expert's tensors are
sent whole by the rank that holds it, and nothing by the others.

Anything else (FSDP1 flat parameters, ZeRO-3 partitions, a 2-D mesh, ``Shard(1)``, a LoRA
policy, whose merged weights are computed from several tensors, a checkpoint tensor that
transformers' conversion computes rather than cuts out) has no such share: the push then
gathers on every rank and rank 0 sends (``fronts/lightning/roles.LockstepWeights``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.checkpoint_layout import CheckpointWeights
from lightning_vllm.weights.layer_sums import tensor_sums
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
        source: the policy's weights (an FSDP2 model, or one every rank holds whole), as they are in memory or in
            the checkpoint's layout (``CheckpointWeights``).
        rank: this trainer rank.
        world_size: how many trainer ranks send.

    Example::

        >>> from lightning_vllm.weights.sources import ModuleWeights
        >>> shares = RankShares(ModuleWeights(torch.nn.Linear(3, 2)), rank=1, world_size=2)
        >>> shares.counts("weight"), [tuple(piece.shape) for _, piece in shares.iter_full()]
        ([3, 3], [(3,), (1,)])
    """

    def __init__(self, source: Weights, rank: int, world_size: int) -> None:
        self.source = source
        self.rank = rank
        self.world_size = world_size
        # Per tensor sent: the tensor in memory it is a run of, how many of that tensor's elements each rank
        # holds, and which of them this rank sends.
        self._runs: dict[str, tuple[torch.Tensor, list[int], tuple[int, int]]] = {}
        self._counts: dict[str, list[int]] = {}
        for name, tensor, begin, length in tensor_runs(source):
            held = share_counts(tensor, world_size)
            if isinstance(held, str):
                raise ValueError(f"{name!r} has no share of its own on each rank: {held}.")
            spans = _within(held, begin, length)
            self._runs[name] = (tensor, held, spans[rank])
            self._counts[name] = [stop - start for start, stop in spans]

    @classmethod
    def of(cls, source: Weights, rank: int, world_size: int) -> RankShares | str:
        """This rank's shares of ``source``, or why it cannot be sent in shares."""
        model = source.source if isinstance(source, CheckpointWeights) else source
        if type(model) is not ModuleWeights:  # a LoRA merge or an FSDP1/ZeRO-3 source: computed or gathered
            return f"a {type(model).__name__} is not sent in shares (only a plain or FSDP2 model is)"
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

    def sums(self, sent: Sequence[tuple[str, torch.dtype]]) -> dict[str, list[int]]:
        """The fingerprints (``layer_sums.tensor_sums``) of this rank's shares of the tensors ``sent`` names, each in
        the dtype it went on the wire in: a tensor's fingerprint is the sum of its shares', so rank 0 adds the other
        ranks' to its own for the check after the push (``EveryRankSend.share_sums``)."""
        dtypes = dict(sent)
        return {
            name: [int(value) for value in tensor_sums(share, dtypes[name]).tolist()]
            for name, share in self.iter_full()
            if name in dtypes
        }

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, this rank's flat share)``; not the full tensors despite the name (see the class)."""
        for name, (tensor, held, (start, stop)) in self._runs.items():
            first = sum(held[: self.rank])  # the first element of ``tensor`` this rank holds
            yield name, local_share(tensor, self.rank, held)[start - first : stop - first]


def tensor_runs(source: Weights) -> Iterator[tuple[str, torch.Tensor, int, int]]:
    """``(name sent, tensor in memory, first element, number of elements)`` of every tensor ``source`` sends, in
    its order: each is that run of the tensor's elements, in row-major order. ``source`` is a model's
    :class:`ModuleWeights`, or those in the checkpoint's layout.

    Raises:
        ValueError: a tensor sent is not one run of a tensor in memory (transformers' conversion computes it).

    Example::

        >>> linear = torch.nn.Linear(2, 3)
        >>> [(name, begin, length) for name, _, begin, length in tensor_runs(ModuleWeights(linear))]
        [('weight', 0, 6), ('bias', 0, 3)]
    """
    if not isinstance(source, CheckpointWeights):
        for name, param in cast(ModuleWeights, source).named_parameters():
            yield name, param, 0, param.numel()
        return
    # The plan's own conversion, run on empty tensors of the in-memory shapes: each checkpoint tensor comes out as
    # the same tensor, a view of one (whose offset and strides say which run it is), or something computed.
    params = dict(cast(ModuleWeights, source.source).named_parameters())
    placeholders = {name: torch.empty(param.shape, dtype=param.dtype, device="meta") for name, param in params.items()}
    by_id = {id(placeholder): name for name, placeholder in placeholders.items()}
    for name, made in source.plan.convert(placeholders.items()):
        if made.device.type != "meta":  # a persistent buffer the checkpoint holds: every rank holds it whole
            yield name, made, 0, made.numel()
            continue
        base = made if id(made) in by_id else made._base
        if base is None or id(base) not in by_id or not made.is_contiguous():
            raise ValueError(
                f"{name!r} is not one run of a tensor in memory: transformers' conversion into the checkpoint's "
                "layout computes it"
            )
        yield name, params[by_id[id(base)]], int(made.storage_offset()), made.numel()


def _within(held: Sequence[int], begin: int, length: int) -> list[tuple[int, int]]:
    """Per rank, the elements ``[start, stop)`` of the run ``[begin, begin + length)`` it holds (rank ``k`` holds
    ``held[k]`` elements, after those of the ranks before it); empty, at the first it holds, where it holds none.

    Example::

        >>> _within([4, 4], begin=2, length=4), _within([4, 4], begin=4, length=2)
        ([(2, 4), (4, 6)], [(0, 0), (4, 6)])
    """
    spans, first = [], 0
    for count in held:
        start, stop = max(begin, first), min(begin + length, first + count)
        spans.append((start, stop) if start < stop else (first, first))
        first += count
    return spans


class EveryRankSend(ABC):
    """Rank 0's side of a push every trainer rank sends a share of, as the transport sees it.

    For each engine, the transport tells the other ranks what this pass carries
    (:meth:`begin_pass`), sends rank 0's shares while they send theirs, and hears from
    them once the bytes have moved (:meth:`end_pass`), before the engine commits.
    ``fronts/lightning/every_rank.py`` implements it on the trainer's status group.

    It is the every-rank interface: the one place a backend calls up into a front end (``Payload.every_rank`` carries
    it down through the core, and no signature between names it), besides the post hooks a user registers.
    """

    shares: RankShares
    senders: list[dict[str, Any]]
    """Where the workers reach trainer ranks 1, 2, ...: ``{"address", "port"}`` each."""
    share_sums: dict[str, list[int]]
    """The other ranks' shares' fingerprints, added up per tensor (``RankShares.sums``), as :meth:`end_pass` heard
    them when the push is checked: the check after the push adds them to rank 0's."""

    @abstractmethod
    def begin_pass(self, announced: dict[str, Any]) -> None:
        """Tell the other ranks a pass: ``announced`` is the backend's word for it (JSON data), which each other
        rank's :class:`ShareSender` acts on."""

    @abstractmethod
    def end_pass(self, error: BaseException | None) -> None:
        """Hear whether every rank sent its shares (``error``: rank 0's failure, told to the others).

        Raises:
            WeightSyncError: another rank failed (only when ``error`` is ``None``).
        """


class ShareSender(ABC):
    """A trainer rank other than 0's end of a push every rank sends a share of, as its backend makes it
    (``Backend.share_sender``): where the workers reach this rank, and each pass's shares sent to them."""

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """Where the workers reach this rank: ``{"address", "port"}``."""

    @abstractmethod
    def send_pass(self, announced: dict[str, Any], shares: RankShares, bucket_size_bytes: int, timeout: float) -> int:
        """Send this rank's ``shares`` of the pass rank 0 ``announced`` (:meth:`EveryRankSend.begin_pass`) to the
        workers it names; the bytes sent. Every wait is bounded by ``timeout``.

        Raises:
            WeightSyncTimeoutError: the workers did not all connect, or a slice did not go out, in time.
            WeightSyncError: a worker's connection broke.
            ValueError: this rank has no share of a tensor the pass names (its policy differs from rank 0's).
        """

    @abstractmethod
    def tensors_of(self, announced: dict[str, Any]) -> list[tuple[str, torch.dtype]]:
        """The tensors the pass rank 0 ``announced`` carries, each with the dtype it goes on the wire in."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening for the workers."""
