"""examples/torchrl_scheme.py end to end (a subprocess): TorchRL's documented weight-sync-scheme usage, with only the
import changed, trains SmolLM2-135M-Instruct while an ``LLMCollector`` samples from a real ``vllm.LLM``; every rollout
comes from the weights the trainer had, under a policy version one higher each step.

The run starts beside the other examples' (``conftest.py``).
"""

from __future__ import annotations

import re

import pytest
from helpers import EXAMPLES

pytestmark = pytest.mark.engine

pytest.importorskip("torchrl", reason="the torchrl extra (make test installs it)")

EXAMPLE_RUNS = {
    "test_the_torchrl_scheme_example_trains_and_keeps_vllm_in_sync": lambda folder: [
        str(EXAMPLES / "torchrl_scheme.py"),
        *["--steps", "3"],
    ],
}

STEP = re.compile(r"^step (\d+): rollout of policy version (\d+), engine weight version (\d+), .* gap ([0-9.e+-]+):")


def test_the_torchrl_scheme_example_trains_and_keeps_vllm_in_sync(example_run):
    _, run = example_run
    completed = run.finish()
    assert completed.returncode == 0, completed.stderr[-4000:]
    steps = [match.groups() for line in completed.stdout.splitlines() if (match := STEP.match(line))]
    assert [(int(step), int(policy), int(engine)) for step, policy, engine, _ in steps] == [
        (0, 1, 1),
        (1, 2, 2),
        (2, 3, 3),
    ]
    assert max(float(gap) for *_, gap in steps) <= 1e-4
