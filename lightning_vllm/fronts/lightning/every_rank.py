"""Pushes every trainer rank sends a share of (``push_from="every_rank"``): no rank-0 funnel.

With ``push_from="rank0"`` (the default) a sharded policy is gathered on every rank and
rank 0 alone sends it, so a push is capped by rank 0's link. With ``"every_rank"`` each
rank sends its own FSDP2 shard of every tensor, as it holds it (``weights/shares.py``):
nothing is gathered, each trainer host's link carries its share of the bytes, and the
workers put the shares together (``backends/gloo/receiver.py``).

The exchange, on the trainer's status group (``ranks.TrainerRanks``):

* every rank says where it listens (rank 0 on the connection made at init; rank ``k`` on
  ``master_port + (number of engines - 1) + k``, or a free port when no ``master_port``
  is given, at :func:`send_address`);
* rank 0 pushes through the updater as usual. For each engine, before the workers are
  told the update, its backend announces the pass to the other ranks (for ``gloo``: the
  workers' group, how many, and its tensors), and each rank's end of it
  (``Backend.share_sender``, kept from its first push) accepts the workers, sends its
  shares and closes their connections;
  then every rank says whether it managed, before the engine commits: a lockstep check-in
  (``TrainerRanks.check_in``), as a sharded push makes before each layer group; when pushes are checked
  (``verify_pushes``), each other rank then gives rank 0 its shares' fingerprints (``RankShares.sums``), which
  rank 0 adds to its own for the check after the push (a tensor's fingerprint is the sum of its shares');
* rank 0 ends with the version it committed, or its error.

A rank that fails fails the push on every rank, with its message (``PushAborted`` on the
others); the engines load nothing of it, as with any failed push. Every wait is bounded:
a rank waits ``RANK_WAIT_FACTOR`` times ``timeout_seconds`` for rank 0's next word.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from lightning_vllm.backends.registry import AUTO, backend_named, carrying
from lightning_vllm.core.versions import PushPointVersions, VersionState
from lightning_vllm.errors import PartialPushError, PushAborted
from lightning_vllm.fronts.lightning.ranks import TrainerRanks
from lightning_vllm.weights.layer_sums import add_sums
from lightning_vllm.weights.payload import Payload
from lightning_vllm.weights.shares import EveryRankSend, RankShares, ShareSender

if TYPE_CHECKING:
    from lightning_vllm.core.push import SyncStats
    from lightning_vllm.core.weight_sync import WeightSync

log = logging.getLogger(__name__)

SEND_ADDRESS_VARIABLE = "LIGHTNING_VLLM_SEND_ADDRESS"
"""The environment variable that sets the address a trainer rank other than 0 listens on."""


def send_address(master_address: str) -> str:
    """The address this rank listens on for the workers: ``$LIGHTNING_VLLM_SEND_ADDRESS`` if set,
    else this host's address on the route to ``master_address`` (rank 0's, which the workers reach).

    Example::

        >>> send_address("127.0.0.1")
        '127.0.0.1'
    """
    if chosen := os.environ.get(SEND_ADDRESS_VARIABLE):
        return chosen
    target = str(socket.getaddrinfo(master_address, None, socket.AF_INET)[0][4][0])
    if ipaddress.ip_address(target).is_loopback:
        return target
    if ipaddress.ip_address(target).is_unspecified:
        raise ValueError(
            f"push_from='every_rank' needs a master_address the workers can reach, not {master_address!r}; "
            f"or set {SEND_ADDRESS_VARIABLE} on each trainer rank."
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))  # a UDP connect only picks the route: nothing is sent
        return str(probe.getsockname()[0])


def push_in_shares(
    updater: WeightSync, payload: Payload, shares: RankShares, ranks: TrainerRanks, point: PushPointVersions
) -> SyncStats | None:
    """Push with every rank sending ``shares``; on every rank at the same point, inside the push point
    ``point``. Returns the figures on rank 0. Every rank's ``updater.versions`` ends on the version
    rank 0 committed, or one more missed push point when the push failed (``point`` skips it).

    Raises:
        WeightSyncError: the push failed on some rank; every rank raises with that rank's message.
    """
    if ranks.rank == 0:
        return _lead(updater, payload, shares, ranks, point)
    point.adopt(VersionState(committed=_follow(updater, shares, ranks)))  # rank 0's, after its commit
    return None


def _lead(
    updater: WeightSync, payload: Payload, shares: RankShares, ranks: TrainerRanks, point: PushPointVersions
) -> SyncStats:
    every = _StatusGroupSend(ranks, shares, _senders(ranks), updater.options.verify_pushes)
    try:
        stats = updater.push(replace(payload, weights=shares, every_rank=every), point=point)
    except PartialPushError as error:
        if not every.aborted:
            _tell(ranks, done=cast("SyncStats", error.stats).weight_version)
        raise
    except BaseException as error:
        if not every.aborted:  # (after an abort the other ranks have left, with its error)
            _tell(ranks, failed={"rank": 0, "message": f"{type(error).__name__}: {error}"})
        raise
    _tell(ranks, done=stats.weight_version)
    return stats


def _senders(ranks: TrainerRanks) -> list[dict[str, Any]]:
    """Where each other rank listens, gathered on rank 0; a rank that could not listen ends the push."""
    endpoints = [json.loads(endpoint) for endpoint in ranks.gather_to_rank_zero(b"")[1:]]
    for rank, endpoint in enumerate(endpoints, start=1):
        if "error" in endpoint:
            failed = {"rank": rank, "message": endpoint["error"]}
            _tell(ranks, failed=failed)
            raise PushAborted(f"The push failed on trainer rank {rank}: {endpoint['error']}")
    return endpoints


def _tell(ranks: TrainerRanks, **word: Any) -> None:
    """Rank 0's word to the other ranks: a pass, ``done`` (the version committed) or ``failed``."""
    ranks.broadcast_bytes(json.dumps(word).encode())


def _follow(updater: WeightSync, shares: RankShares, ranks: TrainerRanks) -> int:
    """A rank other than 0: send this rank's shares for each pass rank 0 announces; rank 0's version."""
    try:
        sender = _share_sender(updater, ranks)
    except Exception as cannot_listen:  # told to rank 0, which ends the push everywhere
        message = f"{type(cannot_listen).__name__}: {cannot_listen}"
        ranks.gather_to_rank_zero(json.dumps({"error": message}).encode())
        ranks.broadcast_bytes(b"")
        raise
    ranks.gather_to_rank_zero(json.dumps(sender.endpoint()).encode())
    while True:
        word = json.loads(ranks.broadcast_bytes(b""))
        if "done" in word:
            return int(word["done"])
        if "failed" in word:
            raise PushAborted(f"The push failed on trainer rank {word['failed']['rank']}: {word['failed']['message']}")
        error: BaseException | None = None
        try:
            options = updater.options
            sender.send_pass(word, shares, options.bucket_size_bytes, options.timeout_seconds)
        except Exception as caught:  # noqa: BLE001  # told to every rank, then raised
            error = caught
        ranks.check_in(error=error)  # every rank says whether it sent its shares (PushAborted if another did not)
        if error is not None:
            raise error
        if updater.options.verify_pushes:  # (the check after the push: this rank's shares' fingerprints, to rank 0)
            ranks.gather_to_rank_zero(json.dumps(shares.sums(sender.tensors_of(word))).encode())


def _share_sender(updater: WeightSync, ranks: TrainerRanks) -> ShareSender:
    """This rank's end of every-rank pushes, from the backend that carries shares: made at its first push and kept
    (closed with ``ranks``)."""
    if ranks.share_sender is None:
        options = updater.options
        backend = backend_named(options.backend if options.backend != AUTO else carrying("carries_shares")[0])
        port = options.master_port + max(len(updater.engines), 1) - 1 + ranks.rank if options.master_port else 0
        ranks.share_sender = backend.share_sender(send_address(options.address), port)
    return ranks.share_sender


class _StatusGroupSend(EveryRankSend):
    """Rank 0's side of the exchange above, for the gloo transport."""

    def __init__(
        self, ranks: TrainerRanks, shares: RankShares, senders: list[dict[str, Any]], verify_pushes: bool
    ) -> None:
        self.ranks = ranks
        self.shares = shares
        self.senders = senders
        self.verify_pushes = verify_pushes
        self.share_sums: dict[str, list[int]] = {}
        self.aborted = False  # a pass failed: the other ranks have left the exchange

    def begin_pass(self, announced: dict[str, Any]) -> None:
        if self.aborted:  # any failed pass ends the push on every rank: the others have left
            raise PushAborted("The push ended at an earlier engine's failure; the engines after it keep their weights.")
        _tell(self.ranks, **announced)

    def end_pass(self, error: BaseException | None) -> None:
        try:
            self.ranks.check_in(error=error)
        except PushAborted:
            self.aborted = True
            raise
        if error is not None:
            self.aborted = True
        elif self.verify_pushes:  # every rank sent its shares: their fingerprints (each tensor's the same every pass)
            self.share_sums = {}
            for gathered in self.ranks.gather_to_rank_zero(b"")[1:]:
                for name, sums in json.loads(gathered).items():
                    add_sums(self.share_sums, name, sums)
