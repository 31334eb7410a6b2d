"""Every selected example run starts when the first one is needed, all side by side.

Most of each run is starting processes (Python, then vLLM's engine core and worker, each importing
torch and vLLM on one core), which two cores do side by side in little more than the time of one.
A test module lists its runs in ``EXAMPLE_RUNS`` (test name: the example's command line, given the
test's folder); each test then waits for its own run and checks it alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import StartedExample


@pytest.fixture(scope="session")
def example_runs(request, tmp_path_factory) -> dict[str, tuple[Path, StartedExample]]:
    """The selected tests' example runs, started together: each test's folder and process, by test name."""
    runs = {}
    for item in request.session.items:
        command_of = getattr(getattr(item, "module", None), "EXAMPLE_RUNS", {})
        if item.name in command_of:
            folder = tmp_path_factory.mktemp(item.name[:30])
            runs[item.name] = folder, StartedExample(command_of[item.name](folder), folder)
    yield runs
    for _, run in runs.values():
        run.kill()


@pytest.fixture
def example_run(request, example_runs) -> tuple[Path, StartedExample]:
    """This test's example run (listed in its module's ``EXAMPLE_RUNS``): its folder and process."""
    return example_runs[request.node.name]
