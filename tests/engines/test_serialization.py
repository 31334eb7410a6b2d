"""Whether an engine will carry vLLM's CUDA IPC handles, read before an ``ipc`` push: from this
process's environment and from the environment a real engine-core process started with."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from lightning_vllm.engines.serialization import (
    INSECURE_SERIALIZATION,
    engine_core_processes,
    ipc_handles_problem,
    process_environment,
    server_ipc_handles_problem,
)


@contextmanager
def waiting_process(**environment: str | None):
    """A real process that waits (the stand-in for an engine core), started with this process's
    environment changed by ``environment`` (``None``: left out); a bare interpreter, so it starts at once.
    Yielded as vLLM's engine manager holds a spawned engine core: its pid and its start method."""
    env = {key: value for key, value in os.environ.items() if key not in environment}
    env.update({key: value for key, value in environment.items() if value is not None})
    code = "import sys, time; print('ready', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield SimpleNamespace(pid=process.pid, _start_method="spawn")
    finally:
        process.kill()
        process.wait(5)


def engine_core_client(*processes):
    """What vLLM's multiprocess engine-core client exposes: a request socket and the processes it started."""
    return SimpleNamespace(
        _send_input=lambda *args: None,
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=list(processes))),
    )


@pytest.mark.parametrize("variable", ["1", None])
def test_an_engine_core_in_the_trainers_process_cannot_take_ipc_whatever_the_variable(variable, monkeypatch):
    if variable is None:
        monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    else:
        monkeypatch.setenv(INSECURE_SERIALIZATION, variable)
    problem = ipc_handles_problem(SimpleNamespace(resources=None), "in-process vllm.LLM")  # vLLM's InprocClient
    assert problem is not None and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in problem
    assert "invalid device context" in problem and "a process of its own" in problem


def test_without_the_variable_in_this_process_the_error_names_it_and_the_fix(monkeypatch):
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    problem = ipc_handles_problem(engine_core_client(), "in-process vllm.LLM")
    assert problem is not None
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in problem and "before the engine is built" in problem
    assert "CUDA IPC handles" in problem and "docs/security.md" in problem


def test_an_engine_core_started_without_the_variable_is_found_out_though_this_process_has_it(monkeypatch):
    with waiting_process(**{INSECURE_SERIALIZATION: None}) as started_without:
        monkeypatch.setenv(INSECURE_SERIALIZATION, "1")  # set after the engine core started: too late for it
        assert process_environment(started_without.pid) is not None
        problem = ipc_handles_problem(engine_core_client(started_without), "in-process AsyncLLM")
    assert problem is not None and f"pid {started_without.pid}" in problem
    assert "started without it" in problem


def test_an_engine_core_started_with_the_variable_takes_the_handles(monkeypatch):
    monkeypatch.setenv(INSECURE_SERIALIZATION, "1")
    with waiting_process() as process:
        assert process_environment(process.pid)[INSECURE_SERIALIZATION] == "1"
        assert ipc_handles_problem(engine_core_client(process), "in-process vllm.LLM") is None


def test_a_server_says_in_its_server_info_whether_it_unpickles_the_handles():
    assert server_ipc_handles_problem({INSECURE_SERIALIZATION: True}, "vLLM server") is None
    assert server_ipc_handles_problem(None, "vLLM server") is None  # an older server that does not say
    problem = server_ipc_handles_problem({INSECURE_SERIALIZATION: False}, "vLLM server at http://127.0.0.1:1")
    assert problem is not None and "Restart it with VLLM_ALLOW_INSECURE_SERIALIZATION=1" in problem


def test_the_variable_reads_as_vllm_reads_it():
    from lightning_vllm.engines.serialization import flag_set

    assert [flag_set(v) for v in ("1", "2", "0", "", "yes", None)] == [True, True, False, False, False, False]


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["vllm.LLM", "AsyncLLM"])
def test_the_engine_core_of_a_real_engine_is_found_and_read(kind, request, monkeypatch):
    """What the check reads of vLLM's own objects: the engine-core process of a real multiprocess engine."""
    from lightning_vllm import LocalLLMEngine

    if kind == "vllm.LLM":
        target = LocalLLMEngine(request.getfixturevalue("llm"))
        engine_core = target.llm.llm_engine.engine_core
    else:
        target = request.getfixturevalue("async_engine")
        engine_core = target.async_llm.engine_core
    (process,) = engine_core_processes(engine_core)
    assert process.is_alive() and process._start_method in ("fork", "spawn")
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    assert "lacks" in target.ipc_handles_problem()
    monkeypatch.setenv(INSECURE_SERIALIZATION, "1")
    started_with = (process_environment(process.pid) or {}).get(INSECURE_SERIALIZATION)
    expected_refusal = process._start_method == "spawn" and started_with != "1"
    assert (target.ipc_handles_problem() is not None) == expected_refusal
