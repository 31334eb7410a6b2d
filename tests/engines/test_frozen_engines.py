"""An engine that stops answering ends a rollout in time, whatever the kind of engine, and
serves again once it answers (its engine core frozen with SIGSTOP, then resumed)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from vllm import SamplingParams

from lightning_vllm import VLLMWeightSync, WeightSyncTimeoutError

pytestmark = pytest.mark.engine

FREEZE_TIMEOUT_SECONDS = 3.0


def engine_core_of(root_pid: int) -> int:
    """The pid of the one vLLM engine core below ``root_pid``."""
    (core,) = [child for child in psutil.Process(root_pid).children(recursive=True) if "EngineCor" in child.name()]
    return core.pid


def ray_actor_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda actor_self: os.getpid()), timeout=60)


# What the user passes as engine=..., and the pid of its engine core.
ENGINES = {
    "in-process vllm.LLM": lambda request: (
        llm := request.getfixturevalue("llm"),
        llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid,
    ),
    "AsyncLLM": lambda request: (
        engine := request.getfixturevalue("async_engine"),
        engine.async_llm.engine_core.resources.engine_manager.processes[0].pid,
    ),
    "vllm serve": lambda request: (
        (server := request.getfixturevalue("server")).url,
        engine_core_of(server.process.pid),
    ),
    "Ray actor": lambda request: (
        actor := request.getfixturevalue("actor"),
        engine_core_of(ray_actor_pid(actor)),
    ),
}


@pytest.mark.parametrize("kind", ENGINES)
def test_a_frozen_engine_ends_the_rollout_in_time_and_serves_again_after(kind, request):
    given, core_pid = ENGINES[kind](request)
    sync = VLLMWeightSync(engine=given, generate_timeout_seconds=60)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    (before,) = sync.generate([[1, 2, 3]], params)

    os.kill(core_pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeoutError, match=f"Timed out after {FREEZE_TIMEOUT_SECONDS:g} s"):
            sync.generate([[1, 2, 3]], params, timeout_seconds=FREEZE_TIMEOUT_SECONDS)
        assert time.monotonic() - start < FREEZE_TIMEOUT_SECONDS + 5
    finally:
        os.kill(core_pid, signal.SIGCONT)

    (after,) = sync.generate([[1, 2, 3]], params)  # waits for the generate that timed out first
    assert after.token_ids == before.token_ids
