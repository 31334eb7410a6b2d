"""The GPU tier: lightning-vllm against vLLM's own engine (engine core, worker, model runner) on one CUDA GPU.

Run it on the GPU host, from a clean checkout plus ``.gpu-carry`` (``make gpu-carry`` here):
``make test-gpu`` (``ipc`` and ``lightning_ipc``), ``make test-gpu-moe`` (``test_gpu_moe.py``), ``make test-gpu-nccl``
and ``make test-gpu-nccl-nodes`` (``nccl``: ``tests/gpu/nccl``), each one call of at most 9 minutes. On a
machine without CUDA every test here is skipped, saying why (CI never runs them). docs/gpu.md
has the last run's results and what ran: vLLM 0.33's Python sources with torch-native stand-ins
for its compiled kernels (``tests/gpu/host/vllm_native_C.py``), Triton attention, eager mode.

Engines take 30-40 s to start there: they are shared, one per kind, for the whole session, and
built with the fix that ``ipc`` needs (``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before the engine
starts); the test of the refusal without it builds its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu_helpers import FIGURES, HOST_SETUP, gpu_llm, gpu_server, stop_llm  # noqa: E402
from helpers import save_model, save_tokenizer, tiny_qwen2  # noqa: E402

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``ends_engine`` (a shared engine's core killed) run after every other test; without CUDA every
    test here is skipped."""
    items.sort(key=lambda item: item.get_closest_marker("ends_engine") is not None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"the GPU tier needs a CUDA GPU and vLLM's engine there ({HOST_SETUP})")
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the GPU host, each failure and the figures so far go to ``$OUT`` as they come: a call cut short by its time
    limit still brings back what ran (pytest's summary comes only at the end)."""
    out = os.environ.get("OUT")
    if not out or not torch.cuda.is_available():
        return
    if report.failed:
        with open(Path(out, "failures.log"), "a") as failures:
            failures.write(f"\n===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")
            for name, text in report.sections:
                failures.write(f"--- {name}\n{text[-6000:]}\n")
    if report.when == "teardown" and FIGURES:
        import json

        Path(out, "gpu_figures.json").write_text(json.dumps(FIGURES, indent=1, sort_keys=True, default=str))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not FIGURES:
        return
    import json

    text = json.dumps(FIGURES, indent=1, sort_keys=True, default=str)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_figures.json").write_text(text)
    print("\nGPU tier figures:", text)


@pytest.fixture(scope="session", autouse=True)
def server_starting(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gpu_model_dir: Path):
    """``vllm serve``, started at the beginning of the session when it runs the server's tests (``None`` otherwise),
    healthy before any other engine starts: an engine stopped while the server profiled GPU memory failed its
    start (vLLM's ``assert init_free_memory >= free_gpu_memory``, tier run on 58e039e)."""
    wanted = torch.cuda.is_available() and any("test_gpu_server" in item.nodeid for item in request.session.items)
    if not wanted:
        yield None
        return
    logs = Path(os.environ["OUT"]) if os.environ.get("OUT") else tmp_path_factory.mktemp("server")
    server = gpu_server(gpu_model_dir, logs / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def insecure_serialization():
    """What vLLM's ipc backend needs in every process, set before the shared engines start (docs/security.md)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny float32 Qwen2 the engines start from, with a tokenizer for the server's completions route."""
    directory = tmp_path_factory.mktemp("tiny-qwen2-gpu")
    save_model(tiny_qwen2(seed=0), directory)
    return save_tokenizer(directory)


@pytest.fixture(scope="session")
def ipc_llm(gpu_model_dir: Path, insecure_serialization):
    """A ``vllm.LLM`` on the GPU (multiprocess engine core) with vLLM's ipc backend."""
    llm = gpu_llm(gpu_model_dir)
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="session")
def async_ipc_engine(gpu_model_dir: Path, insecure_serialization):
    """An ``AsyncLLM`` on the GPU with the ipc backend, behind its engine target."""
    from gpu_helpers import engine_settings
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from lightning_vllm import AsyncLLMEngine

    engine = AsyncLLMEngine(AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_settings(gpu_model_dir))))
    yield engine
    engine.async_llm.shutdown(timeout=2.0)


@pytest.fixture(scope="session")
def lightning_ipc_llm(gpu_model_dir: Path, insecure_serialization):
    """A ``vllm.LLM`` on the GPU whose workers load with one copy (``lightning_ipc``), built with no worker
    extension: the check after every push asks the methods our plugin gives its workers, by name."""
    llm = gpu_llm(gpu_model_dir, backend="lightning_ipc")
    yield llm
    stop_llm(llm)
