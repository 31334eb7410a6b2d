"""When a push is due: the decision alone, a pure function of the global step, the epoch and the
step last pushed (the callback in ``fronts/lightning/callback.py`` acts on it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushSchedule:
    """When a push is due; ``0`` turns an interval off.

    ``trainer.global_step`` moves only at an optimizer step and stays put for the
    batches of a gradient-accumulation cycle, so a push is due once per step: never
    again at the step last pushed (as ``ModelCheckpoint`` remembers the step it saved).

    Example::

        >>> schedule = PushSchedule(every_n_train_steps=2)
        >>> [step for step in range(1, 7) if schedule.due_after_batch(step, last_pushed_step=-1)]
        [2, 4, 6]
        >>> schedule.due_after_batch(4, last_pushed_step=4)
        False
    """

    every_n_train_steps: int = 0
    every_n_epochs: int = 0

    def __post_init__(self) -> None:
        if self.every_n_train_steps < 0:
            raise ValueError(f"Invalid value for every_n_train_steps={self.every_n_train_steps}. Must be >= 0.")
        if self.every_n_epochs < 0:
            raise ValueError(f"Invalid value for every_n_epochs={self.every_n_epochs}. Must be >= 0.")

    def due_after_batch(self, global_step: int, last_pushed_step: int) -> bool:
        """Whether to push after a training batch that left the trainer at ``global_step``."""
        every = self.every_n_train_steps
        return bool(every) and global_step > 0 and global_step % every == 0 and global_step != last_pushed_step

    def due_after_epoch(self, epochs_done: int, global_step: int, last_pushed_step: int) -> bool:
        """Whether to push after ``epochs_done`` training epochs, unless this step was just pushed."""
        every = self.every_n_epochs
        return bool(every) and epochs_done % every == 0 and global_step != last_pushed_step
