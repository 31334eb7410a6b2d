"""The trainer's ranks: a gloo status group of their own (:class:`TrainerRanks`), on which a push every rank takes
part in checks in between gathers (``roles.py``), rank 0 shares its versions (``push_points.py``) and its errors
(``rollouts.py``), and the every-rank exchange runs (``every_rank.py``). Every wait on it is bounded by
``RANK_WAIT_FACTOR`` times ``timeout_seconds``.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_vllm.errors import PushAborted, WeightSyncError, WeightSyncTimeoutError
from lightning_vllm.weights.shares import ShareSender
from lightning_vllm.weights.survey import survey

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
