"""What the callback costs a training run: pushing every step versus never.

The same short ``Trainer.fit`` runs twice per round, alternately: with
``VLLMWeightSync(every_n_train_steps=1)`` and without the callback. As in online RL,
every training step first samples a short rollout from the engine, in both runs. The
policy trains in float32, as mixed-precision training keeps its weights, and the
engine serves bfloat16, so each push also converts.

Why the rollout matters on a small machine: after answering a call, vLLM's worker
busy-waits for a second for the next one. Without rollouts, only the push wakes
it, and its spinning then slows the next training step; with rollouts it spins
after every step either way, and what remains is the push itself. The extra time
per step should be the push itself and nothing more, so the report sets the
difference against the time spent inside ``push`` (``push_weights``).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from training import fit_seconds

from lightning_vllm import VLLMWeightSync
from lightning_vllm.core.weight_sync import WeightSync
from lightning_vllm.options import UpdaterOptions


class TimedUpdater(WeightSync):
    """A core that records the wall-clock seconds of every push, as the callback sees them (the callback pushes
    through ``WeightSync.push``; timing a front end's method would time nothing: ``ms inside push_weights`` read 0)."""

    def __init__(self, engine: Any, timeout_seconds: float) -> None:
        super().__init__(engine, options=UpdaterOptions(timeout_seconds=timeout_seconds))
        self.push_seconds: list[float] = []

    def push(self, *args: Any, **kwargs: Any) -> Any:  # (what the callback calls)
        start = time.perf_counter()
        try:
            return super().push(*args, **kwargs)
        finally:
            self.push_seconds.append(time.perf_counter() - start)


@dataclass
class CallbackCost:
    """Medians over rounds, in seconds per training step."""

    num_steps: int
    step_never: float
    step_every: float
    push: float

    @property
    def extra(self) -> float:
        return self.step_every - self.step_never

    @property
    def overhead(self) -> float:
        """What pushing every step costs beyond the pushes themselves."""
        return self.extra - self.push


def measure_callback_cost(
    llm: Any, model: torch.nn.Module, *, vocab_size: int, num_steps: int, num_rounds: int, warm_up: bool = True
) -> CallbackCost:
    """Medians over ``num_rounds`` rounds of the two fits, after one discarded round if ``warm_up``."""
    model = copy.deepcopy(model).float()
    tokens = torch.randint(0, vocab_size, (num_steps * 2, 64), generator=torch.Generator().manual_seed(0))
    never: list[float] = []
    every: list[float] = []
    push: list[float] = []
    for round_index in range(0 if warm_up else 1, num_rounds + 1):  # round 0 warms up and is discarded
        updater = TimedUpdater(engine=llm, timeout_seconds=600)
        seconds_never = fit_seconds(model, llm, tokens, num_steps, callbacks=[])
        sync = VLLMWeightSync(updater=updater, every_n_train_steps=1)
        seconds_every = fit_seconds(model, llm, tokens, num_steps, callbacks=[sync])
        updater.close()
        if round_index:
            never.append(seconds_never / num_steps)
            every.append(seconds_every / num_steps)
            push.append(sum(updater.push_seconds) / num_steps)
    return CallbackCost(num_steps, statistics.median(never), statistics.median(every), statistics.median(push))
