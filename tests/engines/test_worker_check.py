"""How the workers of an in-process engine are asked for their sums after a push: by the extension's method name,
else by a function, but only where the engine core can decode one (a real process stands in for the core)."""

from __future__ import annotations

from types import SimpleNamespace

from test_serialization import engine_core_client, waiting_process

from lightning_vllm.engines.serialization import INSECURE_SERIALIZATION
from lightning_vllm.engines.worker_check import LAYER_SUMS_METHOD, WORKER_EXTENSION, layer_sums_of_worker, rpc_for


def _config(extension: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=extension))


def test_the_extension_is_asked_by_name_and_an_in_process_core_is_sent_the_function(monkeypatch):
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    assert rpc_for(_config(WORKER_EXTENSION), engine_core_client()) == LAYER_SUMS_METHOD
    assert rpc_for(_config(), SimpleNamespace(resources=None)) is layer_sums_of_worker  # vLLM's InprocClient
    assert rpc_for(_config(), engine_core_client()) is None  # nothing pickled without the variable


def test_an_engine_core_started_without_the_variable_is_not_sent_a_function_though_this_process_has_it(monkeypatch):
    # Seen on an H200: the core's input thread stopped at the pickled function, and the engine answered nothing.
    with waiting_process(**{INSECURE_SERIALIZATION: None}) as started_without:
        monkeypatch.setenv(INSECURE_SERIALIZATION, "1")
        assert rpc_for(_config(), engine_core_client(started_without)) is None
    with waiting_process(**{INSECURE_SERIALIZATION: "1"}) as started_with:
        assert rpc_for(_config(), engine_core_client(started_with)) is layer_sums_of_worker
