"""How the trainer's ranks push a sharded policy, side by side (chosen at fit start by :func:`choose_rank_roles`;
a policy every rank holds whole is pushed by rank 0 alone, ``push_points.py``): every rank gathering it in lockstep
(:class:`LockstepGathers`), or every rank sending its own share (:class:`EveryRankShares`, through the every-rank
exchange of ``every_rank.py``).

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
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
from typing_extensions import override
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.core.versions import VersionState
from lightning_vllm.errors import PushAborted, WeightSyncError
from lightning_vllm.fronts.lightning.every_rank import push_in_shares
from lightning_vllm.fronts.lightning.ranks import DONE, PROCEED, TrainerRanks
from lightning_vllm.options import PushFrom
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.payload import Payload, PushView
from lightning_vllm.weights.shares import RankShares
from lightning_vllm.weights.survey import Surveys

if TYPE_CHECKING:
    from lightning_vllm.core.push import SyncStats
    from lightning_vllm.core.weight_sync import WeightSync

log = logging.getLogger(__name__)


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


class LockstepGathers:
    """A sharded policy: every rank gathers in lockstep (checking in before each layer group), rank 0 sends.

    Args:
        ranks: the trainer's ranks.
    """

    def __init__(self, ranks: TrainerRanks) -> None:
        self.ranks = ranks

    def push(self, sync: WeightSync, module: torch.nn.Module) -> SyncStats | None:
        """Push ``module``'s weights now, blocking; on every rank, at the same point. Returns the figures on rank 0
        (``None`` elsewhere). Every rank's ``sync.versions`` ends the same: the version rank 0 committed, or one more
        missed push point when the push failed.

        Raises:
            WeightSyncError: the push failed (on some rank: every rank raises with its message).
        """
        ranks = self.ranks
        weights: LockstepWeights | None = None
        agreed = sent_in_shares = False  # agreed on the payload; pushed in shares
        with sync.versions.push_point() as point:  # (a push point that sends nothing is skipped)
            try:
                surveys = Surveys()  # (the policy's modules walked once, by the view's choice and the payload's)
                view = _decided_on_rank_zero(lambda: sync.choose_view(module, surveys=surveys), ranks)
                agreed = True
                # No stamps: a sharded policy's groups are all gathered and sent (the engine's copy is then unknown).
                payload = replace(sync.choose_payload(module, view=view, surveys=surveys), stamps=None)
                weights = LockstepWeights(payload.weights, ranks)
                weights.check_in(PROCEED)  # every rank has its weights: vLLM may be touched
                # (a collective: every rank decides alike)
                shares = self.shares_of(payload)
                if shares is not None:
                    sent_in_shares = True  # (a push in shares shares its errors itself)
                    return push_in_shares(sync, payload, shares, ranks, point)
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

    def shares_of(self, payload: Payload) -> RankShares | None:
        """This rank's own shares of ``payload`` when every rank is to send its own instead of gathering it, else
        ``None`` (a collective: every rank decides alike): never here (:class:`EveryRankShares`)."""
        return None


def _decided_on_rank_zero(decide: Callable[[], PushView], ranks: TrainerRanks) -> PushView:
    """How this push sends the policy (``WeightSync.choose_view``), decided on rank 0 for every rank.

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


class EveryRankShares(LockstepGathers):
    """``push_from="every_rank"``: each rank sends its own share of every tensor when every rank holds
    one (FSDP2); gathered in lockstep, rank 0 sending, otherwise (a LoRA adapter, another policy).

    Args:
        ranks: the trainer's ranks.
    """

    @override
    def shares_of(self, payload: Payload) -> RankShares | None:
        """This rank's shares of ``payload``, if every rank has its own (a collective); else ``None``,
        with a warning (once) that says why the push is gathered and sent by rank 0 instead."""
        ranks = self.ranks
        shares: RankShares | str = "a LoRA adapter push is gathered"
        if not payload.carries_adapter:
            shares = RankShares.of(payload.weights, ranks.rank, ranks.world_size)
        if ranks.every_rank(isinstance(shares, RankShares)):
            return shares if isinstance(shares, RankShares) else None
        if not ranks.warned_gathered:
            ranks.warned_gathered = True
            why = shares if isinstance(shares, str) else "another rank's policy has no share of its own"
            log.warning("push_from='every_rank': this push is gathered and sent by rank 0 instead, as %s.", why)
        return None


def choose_rank_roles(ranks: TrainerRanks, sharded: bool, push_from: PushFrom) -> LockstepGathers | None:
    """The rank roles of every push of a fit: ``None`` (rank 0 alone) unless the policy is sharded; then lockstep
    gathers, or every rank's own share with ``push_from="every_rank"``."""
    if not sharded:
        return None
    return EveryRankShares(ranks) if push_from == "every_rank" else LockstepGathers(ranks)
