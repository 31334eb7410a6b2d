"""A CPU engine that says it was built with sleep mode: the sleep tests' engine on vLLM's CPU build."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lightning_vllm.engines.local import LocalLLMEngine


class SleepingCPUEngine(LocalLLMEngine):
    """A CPU ``vllm.LLM``'s target that says the engine was built with sleep mode, recording the calls that reach
    vLLM. vLLM's CPU build refuses ``enable_sleep_mode=True`` and its workers' sleeps free nothing, but its engine core
    pauses, its executor keeps its sleeping tags and our plugin's notes count levels and drops, as on a GPU
    (``tests/fronts/lightning/test_sleeping.py``)."""

    def __init__(self, llm) -> None:
        super().__init__(llm)
        self.calls: list[str] = []

    def _sleep_mode_enabled(self) -> bool:
        return True

    def sleep(self, level: int, mode: str) -> None:
        self.calls.append(f"sleep {level}")
        super().sleep(level, mode)

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake {','.join(tags) if tags else 'all'}")
        super().wake_up(tags)

    def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append(f"commit {weight_version}")
        super().finish_weight_update(weight_version)

    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        self.calls.append("generate")
        return super().generate(prompts, sampling_params, timeout_seconds=timeout_seconds)


@contextmanager
def sleeping_cpu_engine(llm) -> Iterator[SleepingCPUEngine]:
    """A :class:`SleepingCPUEngine` of the shared ``llm``, awake again afterwards for the next test."""
    try:
        yield SleepingCPUEngine(llm)
    finally:
        if llm.llm_engine.is_sleeping():
            llm.wake_up()
