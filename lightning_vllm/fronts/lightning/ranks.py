"""Which trainer ranks take part in a push (:class:`RankRoles`), and the pushes every rank takes part in:
policies sharded across ranks (FSDP2, FSDP, ZeRO-3).

A sharded parameter is gathered with a collective, so every rank must walk the
weights in the same order at the same time; only global rank 0 sends to vLLM.
Each rank iterates a :class:`LockstepWeights` over its own view of the model. Before
each layer group is gathered, the ranks check in on a gloo group of their own
(bounded by ``RANK_WAIT_FACTOR`` times ``timeout_seconds``), each saying whether it can go on:

* every rank checks in once before anything else, so a rank that cannot even build
  its view of the weights stops the push before vLLM is touched;
* rank 0 says ``PROCEED`` before each group (for every engine it pushes to, one pass
  each), then ``DONE`` with the version it committed;
* a rank that failed says ``FAILED`` at its next check-in. Rank 0, whose failures come
  from the transfer (a send error, an engine gone), first finishes the gathers of the
  group under way, as its peers are doing. Every rank then stops at the same group
  boundary, outside any gather, and raises the same error, whose text comes from the
  lowest failing rank.

So no rank waits in a gather for a rank that stopped, and the status group never
waits on the trainer's collectives: each check-in happens between gathers. What
this cannot cover: an exception raised by the gather itself on one rank, or by a
source that is a generator while it is half way through a group (a generator cannot
go on after it raised, so the group's other gathers are not made); its peers then
wait in that group's gathers until the trainer's process-group timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.core.versions import PushPointVersions, VersionState
from lightning_vllm.errors import PushAborted, WeightSyncError, WeightSyncTimeoutError
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.payload import Payload, PushView
from lightning_vllm.weights.shares import RankShares, ShareSender
from lightning_vllm.weights.survey import survey

if TYPE_CHECKING:
    from lightning_vllm.core.push import SyncStats
    from lightning_vllm.core.weight_sync import WeightSync

PROCEED, DONE, FAILED = 0, 1, 2

RANK_WAIT_FACTOR = 4
"""How many ``timeout_seconds`` a rank waits for the others at a check-in. Between two
check-ins rank 0 may spend up to one timeout in each of several bounded calls to vLLM
(pause, start the update, and after a failure release the group and resume), so a
peer must wait longer than any one of them before it calls rank 0 stuck."""


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds parameters that must be gathered across ranks (FSDP2 DTensors, FSDP1 units,
    ZeRO-3 partitions)."""
    from torch.distributed.tensor import DTensor

    found = survey(module)
    return found.fsdp_units or found.zero3_parameters or any(isinstance(p, DTensor) for _, p in found.parameters)


class TrainerRanks:
    """The trainer's ranks, and a gloo group of their own for the status of each push.

    Building it is a collective: every rank of the default process group must build
    it at the same point (the callback does so when fitting starts).

    Args:
        timeout_seconds: the updater's; a rank waits ``RANK_WAIT_FACTOR`` times as long
            for the others at a check-in.
        generate_timeout_seconds: the longest rank 0 may take to generate for every rank;
            the others wait that long, and a minute more, for its answer.
    """

    def __init__(self, timeout_seconds: float, generate_timeout_seconds: float = 0.0) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_seconds = max(RANK_WAIT_FACTOR * timeout_seconds, generate_timeout_seconds + 60.0)
        # gloo whatever the trainer's backend: statuses are tiny CPU tensors, and a
        # group of its own has its own timeout and never queues behind the gathers.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_seconds))
        # This rank's end of pushes every rank sends a share of (push_from="every_rank"), made at the first.
        self.share_sender: ShareSender | None = None
        self.warned_gathered = False  # said once why an every-rank push was gathered instead

    def check_in(self, status: int = PROCEED, version: int = 0, error: BaseException | None = None) -> tuple[int, int]:
        """A lockstep check-in: every rank's status combined (the highest wins) and the highest version offered.

        A rank that failed checks in with its ``error`` (``FAILED``) and shares its message; then every other
        rank raises :class:`PushAborted` naming it, and the failing rank returns, to raise its own error. Sharded
        pushes check in before each layer group (:class:`LockstepWeights`), and every rank's shares after each pass
        (``every_rank.py``).

        Raises:
            PushAborted: another rank failed.
            WeightSyncTimeoutError: a rank did not check in within ``timeout_seconds``.
            WeightSyncError: a rank is gone (its connection broke before that).
        """
        offered = [FAILED if error is not None else status, version]
        agreed, agreed_version = self._ints(dist.all_reduce, offered, op=dist.ReduceOp.MAX)
        if agreed == FAILED:
            rank, message = self.shared_error(None if error is None else f"{type(error).__name__}: {error}")
            if error is None:
                raise PushAborted(f"The push failed on trainer rank {rank}: {message}")
        return agreed, agreed_version

    def shared_error(self, message: str | None) -> tuple[int, str]:
        """The lowest failing rank and its error message, on every rank (``message``: ours, if we failed)."""
        failing = self.rank if message is not None else self.world_size
        [source] = self._ints(dist.all_reduce, [failing], op=dist.ReduceOp.MIN)
        shared = self.broadcast_bytes((message or "").encode()[:4096], source=source)
        return source, shared.decode(errors="replace")

    def every_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a collective)."""
        return bool(self._ints(dist.all_reduce, [int(flag)], op=dist.ReduceOp.MIN)[0])

    def gather_to_rank_zero(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, by rank, on rank 0 (``[]`` elsewhere); raw bytes, never unpickled."""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._collective(dist.all_gather, lengths, tensor=length)
        size = max(int(each[0]) for each in lengths)
        padded = torch.zeros(size, dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else padded[:0]
        received = [torch.zeros(size, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective(dist.all_gather, received, tensor=padded)
        if self.rank != 0:
            return []
        return [data[: int(each[0])].numpy().tobytes() for data, each in zip(received, lengths)]

    def broadcast_bytes(self, payload: bytes, source: int = 0) -> bytes:
        """``source``'s ``payload`` on every rank (what the other ranks pass is ignored); never unpickled."""
        length = torch.tensor([len(payload) if self.rank == source else 0], dtype=torch.int64)
        self._collective(dist.broadcast, length, src=source)
        data = torch.zeros(int(length[0]), dtype=torch.uint8)
        if self.rank == source and payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if int(length[0]):
            self._collective(dist.broadcast, data, src=source)
        return data.numpy().tobytes()

    def _collective(self, operation: Any, first: Any, /, **kwargs: Any) -> None:
        start = time.monotonic()
        try:
            operation(first, group=self.group, **kwargs)
        except RuntimeError as error:  # gloo's own timeout, or a rank that is gone
            waited = time.monotonic() - start
            if waited < self.timeout_seconds:
                raise WeightSyncError(
                    f"Rank {self.rank} lost the other trainer ranks during a push, after {waited:.1f} s ({error}). "
                    "A rank is gone or its connection broke; see its log."
                ) from error
            raise WeightSyncTimeoutError(
                f"Rank {self.rank} waited more than {self.timeout_seconds:g} s for the other trainer ranks during a "
                f"push ({error}). A rank is stuck or gone; see its log."
            ) from error

    def broadcast_ints(self, values: list[int], source: int = 0) -> list[int]:
        """``source``'s ``values`` on every rank (the others pass as many, ignored)."""
        return self._ints(dist.broadcast, values, src=source)

    def _ints(self, operation: Any, values: list[int], **kwargs: Any) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        self._collective(operation, tensor, **kwargs)
        return [int(value) for value in tensor]

    def close(self) -> None:
        if self.share_sender is not None:
            self.share_sender.close()
            self.share_sender = None
        dist.destroy_process_group(self.group)


class LockstepWeights(Weights):
    """A source every rank iterates in the same order, checking in before each layer group's gathers.

    Args:
        source: this rank's weights (gathering a parameter is a collective).
        ranks: the trainer's ranks.
    """

    def __init__(self, source: Weights, ranks: TrainerRanks) -> None:
        self.source = source
        self.ranks = ranks
        self.failed = False  # a check-in agreed on FAILED: the error is to be shared, not reported again
        self._tensors: Iterator[tuple[str, torch.Tensor]] = iter(())
        self._left_in_group = 0

    def declare(self) -> list[ParamMeta]:
        return list(self.source.metadata)

    def groups(self) -> list[list[str]]:
        return self.source.groups()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._tensors = self.source.iter_full()
        for group in self.source.groups():
            self.check_in(PROCEED)
            self._left_in_group = len(group)
            while self._left_in_group:
                self._left_in_group -= 1
                yield next(self._tensors)

    def _finish_group(self) -> None:
        """Gather (and drop) what is left of the group under way: the peers are gathering it."""
        while self._left_in_group:
            self._left_in_group -= 1
            next(self._tensors)

    def follow(self) -> int:
        """Gather group after group, pass after pass, as long as rank 0 says ``PROCEED``; the
        version rank 0 committed once it says ``DONE``. What is gathered is dropped at once."""
        groups = self.source.groups()
        index = len(groups)
        while True:
            status, version = self.check_in(PROCEED)
            if status == DONE:
                return version
            if index == len(groups):  # rank 0 starts a pass (one per engine)
                self._tensors, index = self.source.iter_full(), 0
            self._left_in_group = len(groups[index])
            self._finish_group()
            index += 1

    def check_in(self, status: int, version: int = 0) -> tuple[int, int]:
        """Tell the other ranks ``status`` (``TrainerRanks.check_in``); raises :class:`PushAborted` if any failed."""
        try:
            return self.ranks.check_in(status, version)
        except WeightSyncError:  # another rank failed, or one is stuck or gone
            self.failed = True  # its error is shared, or the status group cannot be trusted for another exchange
            raise

    def fail(self, error: BaseException) -> None:
        """Report this rank's ``error`` at the next check-in and share its message with every rank."""
        if self.failed:
            return
        self.failed = True
        with contextlib.suppress(Exception):  # the source itself broke: peers wait in its gather (see module doc)
            self._finish_group()
        self.ranks.check_in(error=error)


class RankRoles(ABC):
    """Which trainer ranks take part in a push, and how; chosen once when fitting starts
    (``PushPoints.join_ranks``). Three sets of roles, one protocol:

    * ``push_points.RankZeroAlone``: every rank holds the full weights (one process, DDP); rank 0 pushes
      (blocking or in the background) and the others take its versions;
    * :class:`LockstepGathers`: a sharded policy (FSDP2, FSDP, ZeRO-3); every rank gathers in
      lockstep, rank 0 sends;
    * ``every_rank.EveryRankShares``: a sharded policy whose every rank sends its own share
      (``push_from="every_rank"``), gathered in lockstep when it cannot (a :class:`LockstepGathers` given the
      every-rank interface, :class:`SendsShares`).
    """

    every_rank_walks: ClassVar[bool]
    """Every rank walks the policy at each push (a collective): no background push."""

    @abstractmethod
    def push(self, sync: WeightSync, module: torch.nn.Module) -> SyncStats | None:
        """Push ``module``'s weights now, blocking; on every rank taking part, at the same point. Returns
        the figures on the rank that sent (``None`` elsewhere).

        Raises:
            WeightSyncError: the push failed (on some rank: every rank raises with its message).
        """


class SendsShares(Protocol):
    """The every-rank interface (``push_from="every_rank"``, ``every_rank.EveryRankShares``): the one place a
    lockstep push calls into the every-rank protocol, which is built on it."""

    def shares_of(self, payload: Payload) -> RankShares | None:
        """This rank's own shares of ``payload`` when every rank is to send its own instead of gathering it, else
        ``None`` (a collective: every rank decides alike)."""

    def push_shares(
        self, sync: WeightSync, payload: Payload, shares: RankShares, point: PushPointVersions
    ) -> SyncStats | None:
        """Push with every rank sending ``shares``, inside ``point`` (the figures on rank 0)."""


class LockstepGathers(RankRoles):
    """A sharded policy: every rank gathers in lockstep (checking in before each layer group), rank 0 sends;
    with ``shares``, every rank sends its own share instead where each has one.

    Args:
        ranks: the trainer's ranks.
        shares: the every-rank interface (``push_from="every_rank"``), if every rank is to send its own share.
    """

    every_rank_walks: ClassVar[bool] = True

    def __init__(self, ranks: TrainerRanks, shares: SendsShares | None = None) -> None:
        self.ranks = ranks
        self.shares = shares

    def push(self, sync: WeightSync, module: torch.nn.Module) -> SyncStats | None:
        """As :meth:`RankRoles.push`, every rank taking part. Every rank's ``sync.versions`` ends the same:
        the version rank 0 committed, or one more missed push point when the push failed."""
        ranks = self.ranks
        weights: LockstepWeights | None = None
        agreed = sent_in_shares = False  # agreed on the payload; pushed in shares

        def agree(decide: Callable[[], PushView]) -> PushView:
            nonlocal agreed
            view = _decided_on_rank_zero(decide, ranks)
            agreed = True
            return view

        with sync.versions.push_point() as point:  # (a push point that sends nothing is skipped)
            try:
                # No stamps: a sharded policy's groups are all gathered and sent (the engine's copy is then unknown).
                payload = replace(sync.choose_payload(module, agree=agree), stamps=None)
                weights = LockstepWeights(payload.weights, ranks)
                weights.check_in(PROCEED)  # every rank has its weights: vLLM may be touched
                # (a collective: every rank decides alike)
                shares = self.shares.shares_of(payload) if self.shares is not None else None
                if self.shares is not None and shares is not None:
                    sent_in_shares = True  # (a push in shares shares its errors itself)
                    return self.shares.push_shares(sync, payload, shares, point)
                if ranks.rank == 0:
                    stats = sync.push(payload.with_weights(weights), point=point)
                    weights.check_in(DONE, stats.weight_version)
                    return stats
                point.adopt(VersionState(committed=weights.follow()))  # rank 0's, after its commit
                return None
            except BaseException as error:
                if not agreed or sent_in_shares or isinstance(error, PushAborted):
                    raise  # (every rank raises alike at the agreement, before any check-in)
                if weights is None:  # this rank never got its weights: it fails at the first check-in
                    weights = LockstepWeights(_NoWeights(), ranks)
                weights.fail(error)
                raise


def _decided_on_rank_zero(decide: Callable[[], PushView], ranks: TrainerRanks) -> PushView:
    """How this push sends the policy (``WeightSync.choose_payload``), decided on rank 0 for every rank.

    The ranks must iterate the same tensors (merged, adapter alone, or base then adapter)
    to stay in step in their gathers; whether an engine can serve the adapter, or still
    needs the base weights, is known on rank 0 only. Rank 0's error is raised on every
    rank (``PushAborted`` on the others), before any gather.
    """
    view, error = "", None
    if ranks.rank == 0:
        try:
            view = decide()
        except Exception as caught:  # shared so the other ranks stop too, before any gather
            error, view = caught, f"!{type(caught).__name__}: {caught}"
    shared = ranks.broadcast_bytes(view.encode()).decode()
    if error is not None:
        raise error
    if shared.startswith("!"):
        raise PushAborted(f"The push failed on trainer rank 0: {shared[1:]}")
    return cast(PushView, shared)


class _NoWeights(Weights):
    """Stands for the weights of a rank that could not read them, so it can still report the failure."""

    def declare(self) -> list[ParamMeta]:
        return []

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())
