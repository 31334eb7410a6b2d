"""Whether an engine's workers can be asked for their sums, asked once at connect: workers without our plugin, or
with another report format, are named with the fix; the answers of ``vllm serve`` (strings) count as well."""

from __future__ import annotations

import pytest

from lightning_vllm.engines.worker_check import layer_sums_problem
from lightning_vllm.in_vllm.worker_methods import LAYER_SUMS_FORMAT, REPORTS_METHOD


def test_workers_that_answer_the_format_can_be_asked_in_process_or_over_http():
    asked: list[str] = []
    assert layer_sums_problem(lambda method: asked.append(method) or [LAYER_SUMS_FORMAT] * 2, "engine") is None
    assert asked == [REPORTS_METHOD]
    assert layer_sums_problem(lambda method: [str(LAYER_SUMS_FORMAT)], "vllm serve") is None  # (JSON: a string)


def test_workers_without_the_plugin_are_named_with_the_fix():
    def without_plugin(method: str) -> list[int]:
        raise NotImplementedError(f"Method {method!r} is not implemented.")  # (vLLM's run_method says so)

    problem = layer_sums_problem(without_plugin, "in-process vllm.LLM")
    assert problem is not None
    assert "did not load lightning_vllm's vLLM plugin" in problem and "is not implemented" in problem
    assert "Install lightning_vllm in the environment vLLM runs in" in problem and "VLLM_PLUGINS" in problem


@pytest.mark.parametrize("formats", [[1], [LAYER_SUMS_FORMAT, LAYER_SUMS_FORMAT + 1]])
def test_workers_of_another_format_are_named(formats):
    problem = layer_sums_problem(lambda method: formats, "vllm serve")
    assert problem is not None and "install the same lightning_vllm on both sides" in problem
