"""examples/minimal.py end to end (a subprocess: vLLM needs a __main__ guard): vLLM ends on the trained weights.

The run starts beside the other examples' (``conftest.py``).
"""

from __future__ import annotations

import pytest
from helpers import EXAMPLES

pytestmark = pytest.mark.engine

EXAMPLE_RUNS = {
    "test_minimal_example_ends_with_vllm_serving_the_trained_weights": lambda folder: [
        str(EXAMPLES / "minimal.py"),
        *["--steps", "2", "--every-n-train-steps", "2"],
    ],
}


def printed(stdout: str, label: str) -> str:
    """What the example printed after ``label`` on its line."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(label)]
    return line.removeprefix(label).strip()


def test_minimal_example_ends_with_vllm_serving_the_trained_weights(example_run):
    _, run = example_run
    completed = run.finish()
    # Fit start and step 2 pushed; vLLM's prompt logprobs match the trained model's, and did not before.
    assert printed(completed.stdout, "vLLM weight version:").startswith("2 (pushes: 2)")
    assert float(printed(completed.stdout, "max |served - trained| prompt logprob after training:")) < 1e-4
    assert float(printed(completed.stdout, "max |served - trained| prompt logprob before training:")) > 1e-3
