"""How many of the package's modules one steady-state ``gloo`` push runs through, and that its calls run down
(``push_trace.py``): each module is a place a maintainer reads to follow a push, so the count is held down; issue 65
wants at most 17 with the check after every push on (it adds ``core/landing_check`` and ``weights/layer_sums``), the
bound below. A call up (into a module that imports the caller's,
a callable handed down included) is held to none."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from push_trace import assert_few_modules_and_no_call_up, calls_up

MOST_MODULES_A_GLOO_PUSH_ENTERS = 17


@pytest.mark.engine
def test_a_steady_state_gloo_push_runs_through_few_modules(tmp_path):
    script = Path(__file__).parent / "push_trace_run.py"
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=script.parent
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    assert_few_modules_and_no_call_up(found, "lightning_vllm.backends.gloo.trainer", MOST_MODULES_A_GLOO_PUSH_ENTERS)


def test_a_call_into_a_module_that_imports_the_callers_is_a_call_up():
    """What the trace above holds to none: the check's tally once handed to the weights as a callable (issue 65)."""
    calls = [
        ("lightning_vllm.weights.sources", "lightning_vllm.core.landing_check", "LandingCheck._tally"),  # up
        ("lightning_vllm.core.connection", "lightning_vllm.weights.sources", "EngineWeights.groups"),  # down
        ("lightning_vllm.core.connection", "lightning_vllm.backends.gloo.trainer", "Sender.send"),  # down the floors
    ]
    assert calls_up(calls) == [
        "lightning_vllm.weights.sources -> lightning_vllm.core.landing_check.LandingCheck._tally"
    ]
