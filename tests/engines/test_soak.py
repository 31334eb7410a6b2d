"""Fifty pushes in a row leave no growing trace (``make soak`` runs 1000 and 300 through a server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from soak import engine_processes, soak  # noqa: E402

pytestmark = pytest.mark.engine


def test_fifty_pushes_into_an_engine_leave_memory_threads_and_descriptors_flat(llm):
    core = llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
    report = soak("in-process vllm.LLM", llm, engine_processes(core), pushes=50, warmup=10)
    print(report.line())
    assert report.failures() == []
