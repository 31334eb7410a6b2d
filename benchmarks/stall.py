"""How long a push holds the training loop: blocking pushes against ``blocking=False``.

The same short ``Trainer.fit`` as the callback's cost (``callback_cost.py``, ``training.py``: a float32
policy, a 4-token rollout from the engine in every step, a push after every step into a
bfloat16 engine) runs three ways, alternately: without the callback, with
``VLLMWeightSync(every_n_train_steps=1)`` (blocking), and with ``blocking=False,
when_busy="wait"`` (every push point pushes; one that finds the previous push still in
flight waits for it, and that wait counts). The **stall** of a push point is the time the
callback holds the training loop there, as it logs it in ``vllm/sync_stall_seconds``:
the whole push when blocking; checking the push, copying the weights into kept memory
(and any wait) in the background. The push at fit start blocks in both and is left out.
The step times say what the stall does not: on 2 cores a background push competes with
training for the same cores.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from training import MetricsInMemory, fit_seconds

from lightning_vllm import VLLMWeightSync

MODES = ("never", "blocking", "background")


@dataclass
class StallResult:
    """Medians over rounds: seconds per training step, and seconds the loop was held per push point."""

    num_steps: int
    step_seconds: dict[str, float]
    stall_seconds: dict[str, float]  # "blocking" and "background"
    push_seconds: float  # a blocking push, as vllm/sync_seconds logs it

    @property
    def background_over_blocking(self) -> float:
        return self.stall_seconds["background"] / self.stall_seconds["blocking"]


def measure_stall(
    llm: Any, model: torch.nn.Module, *, vocab_size: int, num_steps: int, num_rounds: int, warm_up: bool = True
) -> StallResult:
    """Medians over ``num_rounds`` rounds of the three fits, after one discarded round if ``warm_up``
    (not needed when the callback's cost just ran the same fits on this engine)."""
    model = copy.deepcopy(model).float()
    tokens = torch.randint(0, vocab_size, (num_steps * 2, 64), generator=torch.Generator().manual_seed(0))
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    stalls: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}
    pushes: list[float] = []
    first = 0 if warm_up else 1
    for round_index in range(first, num_rounds + 1):  # round 0 warms up and is discarded
        for mode in MODES:
            callbacks = []
            if mode != "never":
                background = {} if mode == "blocking" else {"blocking": False, "when_busy": "wait"}
                callbacks = [VLLMWeightSync(engine=llm, every_n_train_steps=1, **background)]
            logger = MetricsInMemory()
            seconds = fit_seconds(model, llm, tokens, num_steps, callbacks, logger)
            if not round_index:
                continue
            steps[mode].append(seconds / num_steps)
            if mode != "never":
                held = [value for step, value in logger.metrics["vllm/sync_stall_seconds"] if step > 0]
                stalls[mode].append(statistics.mean(held))
            if mode == "blocking":
                pushes.append(statistics.mean(v for step, v in logger.metrics["vllm/sync_seconds"] if step > 0))
    return StallResult(
        num_steps,
        {mode: statistics.median(values) for mode, values in steps.items()},
        {mode: statistics.median(values) for mode, values in stalls.items()},
        statistics.median(pushes),
    )


def stall_text(result: StallResult, size: str) -> str:
    """The paragraph of the benchmark page."""
    step = result.step_seconds
    return (
        f"{result.num_steps} training steps of the {size} model per fit (float32 policy, a 4-token rollout per "
        f"step, a push after every step into the bfloat16 engine), medians over rounds. The training loop was "
        f"held {result.stall_seconds['blocking'] * 1e3:.0f} ms per push point by a blocking push (the push itself: "
        f"{result.push_seconds * 1e3:.0f} ms) and {result.stall_seconds['background'] * 1e3:.0f} ms with "
        f"`blocking=False`: **async_stall_over_blocking={result.background_over_blocking:.3f}** (target <= 0.25). "
        f"Seconds per step: {step['never']:.3f} without the callback, {step['blocking']:.3f} blocking, "
        f"{step['background']:.3f} in the background (the background push shares the machine's cores with training)."
    )
