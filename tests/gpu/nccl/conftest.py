"""The ``nccl`` GPU tier: lightning-vllm over ``nccl`` into vLLM's own engine, every NCCL party a host of its own on
the one GPU (``nccl_hosts.py``). ``make test-gpu-nccl`` and ``make test-gpu-nccl-nodes`` run it on the GPU host.

Engines are shared for the session and started one after another, each once the GPU's free memory has settled
(``gpu_helpers.gpu_memory_settled``): vLLM's memory profiling fails when another process frees GPU memory while it
runs. Tests marked ``ends_engine`` (an engine core killed) run last (``tests/gpu/conftest.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu_helpers import engine_settings, gpu_llm, gpu_memory_settled, gpu_server, stop_llm  # noqa: E402
from nccl_hosts import become_trainer_host, host_env, starting_as  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def trainer_host() -> None:
    """This process is the trainer's NCCL host, before any NCCL communicator is made in it."""
    if torch.cuda.is_available():
        become_trainer_host()


@pytest.fixture(scope="session")
def nccl_llm(gpu_model_dir: Path) -> Iterator[Any]:
    """A ``vllm.LLM`` over vLLM's ``nccl`` backend, its engine core an NCCL host of its own."""
    with starting_as("engine-llm"):
        llm = gpu_llm(gpu_model_dir, backend="nccl")
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="session")
def lightning_nccl_llm(gpu_model_dir: Path, insecure_serialization) -> Iterator[Any]:
    """A ``vllm.LLM`` over ``lightning_nccl`` (pushes staged and committed whole), its engine core an NCCL host of its
    own; with cloudpickled RPCs, for the digests of what it serves."""
    with starting_as("engine-lightning-nccl"):
        llm = gpu_llm(gpu_model_dir, backend="lightning_nccl")
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="session")
def nccl_async_engine(gpu_model_dir: Path) -> Iterator[Any]:
    """An ``AsyncLLM`` over ``nccl`` behind its engine target, its engine core an NCCL host of its own."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from lightning_vllm import AsyncLLMEngine

    gpu_memory_settled()
    with starting_as("engine-async", measured=False):
        engine = AsyncLLMEngine(AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_settings(gpu_model_dir, "nccl"))))
    yield engine
    engine.async_llm.shutdown(timeout=2.0)


def nccl_serve(model_dir: Path, factory: pytest.TempPathFactory, backend: str, host: str, *extra: str) -> Any:
    """``vllm serve`` over ``backend``, the NCCL host ``host``, with ``PauseLease`` (as docs/engines.md asks: a trainer
    killed while generation is paused would otherwise leave the server paused for good) and ``extra`` arguments; its
    log in ``$OUT`` (or a temporary folder); healthy when returned."""
    logs = Path(os.environ["OUT"]) if os.environ.get("OUT") else factory.mktemp(f"{backend}-server")
    return gpu_server(
        model_dir,
        logs / f"{backend.replace('_', '-')}-server.log",
        backend=backend,
        env=host_env(host),
        extra_args=["--middleware", "lightning_vllm.server.PauseLease", *extra],
    )


@pytest.fixture(scope="session")
def nccl_server(gpu_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``vllm serve`` over ``nccl``, an NCCL host of its own, started and healthy before the fixture returns."""
    server = nccl_serve(gpu_model_dir, tmp_path_factory, "nccl", "engine-serve")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def lightning_nccl_server(gpu_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``vllm serve`` over ``lightning_nccl``, an NCCL host of its own, with no worker extension (the per-layer sums
    are asked for, exact, after each push and by the tests, through the methods our plugin gives every worker),
    started and healthy before it returns."""
    server = nccl_serve(gpu_model_dir, tmp_path_factory, "lightning_nccl", "engine-serve-staged")
    yield server
    server.stop()
