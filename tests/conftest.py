"""Shared fixtures: real vLLM engines are slow to start (~20 s), so tests share them. Fresh interpreters that a test
asks for with the ``fresh_interpreter`` marker start when collection ends, so that their imports overlap the tests
before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import LORA_ENGINE, build_llm, save_model, shutdown, tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 saved with save_pretrained: what vLLM loads at start."""
    return save_model(tiny_qwen2(seed=0), tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def llm(model_dir: Path):
    """A real vLLM engine (multiprocess engine core) with the gloo weight-transfer backend."""
    engine = build_llm(model_dir, backend="gloo", worker_extension_cls="worker_probe.WorkerProbe", **LORA_ENGINE)
    yield engine
    shutdown(engine)


FRESH_INTERPRETER = pytest.StashKey[subprocess.Popen]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start ``python -c code`` for each selected test marked ``fresh_interpreter(code)``. Importing vLLM there takes
    about 8 s on this machine's cores; started now, it runs beside the tests before that one, not in the engine-free
    tier's minute."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("fresh_interpreter")
        if marker is not None:
            item.stash[FRESH_INTERPRETER] = subprocess.Popen(
                [sys.executable, "-c", marker.args[0]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End the fresh interpreters of tests that did not run (``-x``, an interrupted session)."""
    for item in session.items:
        process = item.stash.get(FRESH_INTERPRETER, None)
        if process is not None and process.poll() is None:
            process.kill()
            process.communicate()


@pytest.fixture
def fresh_interpreter(request: pytest.FixtureRequest) -> subprocess.CompletedProcess:
    """What the test's ``fresh_interpreter(code)`` did: its return code, standard output and standard error, waited
    for at most 120 s."""
    process = request.node.stash[FRESH_INTERPRETER]
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
