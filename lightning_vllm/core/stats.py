"""What a push reports: its figures (:class:`SyncStats`), and where its seconds went (:class:`PushTiming`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushTiming:
    """Where the seconds of a push to an engine went, so that a slow link tells itself from a slow engine.

    Attributes:
        transfer_seconds: moving the bytes (the sender's work, the commit left out): what ``GB/s`` is of.
        commit_seconds: the call that finishes the update, and around it the commit window (on
            ``gloo`` the engine loads everything there; vLLM's backends loaded while receiving).
        pause_seconds: how long the engine's generation was paused (around the whole transfer when the
            backend loads while receiving, around the commit otherwise).
        check_seconds: the check after the push (``verify_pushes``): the engine's per-layer sums,
            asked and held against the trainer's (the trainer's own are summed during the transfer).
    """

    transfer_seconds: float = 0.0
    commit_seconds: float = 0.0
    pause_seconds: float = 0.0
    check_seconds: float = 0.0

    def __add__(self, other: PushTiming) -> PushTiming:
        return PushTiming(
            self.transfer_seconds + other.transfer_seconds,
            self.commit_seconds + other.commit_seconds,
            self.pause_seconds + other.pause_seconds,
            self.check_seconds + other.check_seconds,
        )


@dataclass(frozen=True)
class SyncStats:
    """Figures of one push that landed in at least one engine.

    Attributes:
        weight_version: the version committed.
        seconds: how long the push took, every engine included.
        num_bytes: the bytes sent, every engine included.
        engine_indices: the engines that committed it (their positions in ``engine=``).
        failed_engine_indices: the engines it failed on (they keep their previous weights; see
            :class:`~lightning_vllm.errors.PartialPushError`).
        timing: where the seconds went, summed over the engines that took it (:class:`PushTiming`).
    """

    weight_version: int
    seconds: float
    num_bytes: int
    engine_indices: tuple[int, ...] = ()
    failed_engine_indices: tuple[int, ...] = ()
    timing: PushTiming = PushTiming()

    @property
    def gb_per_second(self) -> float:
        """The bytes sent over the seconds spent moving them (``timing.transfer_seconds``), in GB/s
        (1e9 bytes); 0 when nothing moved."""
        seconds = self.timing.transfer_seconds
        return self.num_bytes / seconds / 1e9 if seconds > 0 and self.num_bytes else 0.0
