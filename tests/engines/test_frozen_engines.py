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


def engine_core_of(root_pid: int, timeout: float = 30.0) -> int:
    """The pid of the one vLLM engine core below ``root_pid``.

    Found by its process title ("VLLM::EngineCore") or, where the title was not set (seen in two
    full-suite runs for the Ray actor's engine: every child still named "python"), by its place:
    the one direct child of ``root_pid`` that has a child of its own (its worker). Looked for again
    for up to ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        root = psutil.Process(root_pid)
        children = root.children(recursive=True)
        cores = [child for child in children if "EngineCor" in child.name()]
        if not cores:
            cores = [child for child in root.children() if child.children()]
        if len(cores) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(cores) == 1, f"expected one engine core below pid {root_pid}: {[(c.pid, c.name()) for c in children]}"
    return cores[0].pid


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


class FreezesMidPush:
    """An engine target that stops its engine core (SIGSTOP) once the workers have posted
    their receives for an update: the rest of the push meets a frozen engine."""

    def __init__(self, inner, core_pid: int) -> None:
        self.inner = inner
        self.core_pid = core_pid

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_weights(self, update_info) -> None:
        self.inner.update_weights(update_info)
        os.kill(self.core_pid, signal.SIGSTOP)


@pytest.mark.parametrize("kind", ENGINES)
def test_an_engine_frozen_mid_push_fails_the_push_in_time_and_serves_whole_weights_after(kind, request):
    from helpers import assert_serves, tiny_qwen2

    from lightning_vllm import VLLMUpdater
    from lightning_vllm.engines import as_engine_target

    given, core_pid = ENGINES[kind](request)
    engine = as_engine_target(given)
    old_model, new_model = tiny_qwen2(seed=31), tiny_qwen2(seed=32)
    updater = VLLMUpdater(engine=engine, timeout_seconds=30)
    old_version = updater.push_weights(old_model).weight_version
    updater.close()

    frozen = VLLMUpdater(engine=FreezesMidPush(engine, core_pid), timeout_seconds=FREEZE_TIMEOUT_SECONDS)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeoutError):
            frozen.push_weights(new_model)
        assert time.monotonic() - start < FREEZE_TIMEOUT_SECONDS + 10
    finally:
        os.kill(core_pid, signal.SIGCONT)

    # Back from the freeze, the engine serves one whole set of weights under its own
    # version: the old ones, or the new ones if the update had fully landed.
    updater = VLLMUpdater(engine=engine, timeout_seconds=60)
    stats = updater.push_weights(old_model)  # the next push closes what the frozen one left open
    updater.close()
    assert stats.weight_version > old_version
    assert engine.get_weight_version() == str(stats.weight_version)
    assert_serves(given if kind == "in-process vllm.LLM" else engine, old_model)
