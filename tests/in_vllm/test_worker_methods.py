"""The plugin gives vLLM's worker wrapper the check's methods: vLLM's own ``run_method`` finds them by name, on a
worker built without ``worker_extension_cls``, and a user's extension class still mixes in."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.serial_utils import run_method
from vllm.v1.worker.worker_base import WorkerWrapperBase

from lightning_vllm.in_vllm.plugin import register_backends
from lightning_vllm.in_vllm.worker_methods import (
    LAYER_SUMS_FORMAT,
    LAYER_SUMS_METHOD,
    REPORTS_METHOD,
    SLEEP_STATE_METHOD,
)


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)


def _wrapper_around(model: torch.nn.Module) -> WorkerWrapperBase:
    wrapper = WorkerWrapperBase.__new__(WorkerWrapperBase)  # (vLLM builds it in the worker process; its worker:)
    wrapper.worker = SimpleNamespace(get_model=lambda: model)
    return wrapper


def test_vllms_run_method_finds_the_methods_by_name_on_any_worker():
    register_backends()
    register_backends()  # (vLLM may load plugins more than once)
    model = torch.nn.Module()
    model.norm = _Norm()
    wrapper = _wrapper_around(model)
    assert run_method(wrapper, REPORTS_METHOD, (), {}) == LAYER_SUMS_FORMAT
    report = run_method(wrapper, LAYER_SUMS_METHOD, (), {})
    assert report["replicated"] == {"norm": [4 * 0x3F800000, 4 * 0x3F800000]} and report["stale"] == {}


def test_a_users_worker_extension_does_not_clash_with_them():
    register_backends()

    from vllm.v1.worker.worker_base import WorkerBase

    # vLLM refuses an extension whose names the worker class has: ours are on the wrapper, not on any worker class.
    assert not any(hasattr(WorkerBase, name) for name in (LAYER_SUMS_METHOD, REPORTS_METHOD))
    assert LAYER_SUMS_METHOD in WorkerWrapperBase.__dict__ and REPORTS_METHOD in WorkerWrapperBase.__dict__


def test_the_wrapper_hands_sleep_calls_to_its_worker_and_notes_what_they_left():
    register_backends()
    calls = []
    wrapper = WorkerWrapperBase.__new__(WorkerWrapperBase)
    wrapper.worker = SimpleNamespace(
        sleep=lambda level: calls.append(("sleep", level)),
        wake_up=lambda tags: calls.append(("wake_up", tags)),
        discard=lambda tags: calls.append(("discard", tags)),
    )
    assert run_method(wrapper, SLEEP_STATE_METHOD, (), {}) == {"asleep": [], "level": 0, "dropped": 0}
    run_method(wrapper, "sleep", (), {"level": 1})
    run_method(wrapper, "wake_up", (), {"tags": ["weights"]})
    assert run_method(wrapper, SLEEP_STATE_METHOD, (), {}) == {"asleep": ["kv_cache"], "level": 1, "dropped": 0}
    run_method(wrapper, "wake_up", (), {"tags": None})
    run_method(wrapper, "sleep", (), {"level": 2})
    assert run_method(wrapper, SLEEP_STATE_METHOD, (), {}) == {
        "asleep": ["kv_cache", "weights"], "level": 2, "dropped": 1,
    }  # fmt: skip
    run_method(wrapper, "wake_up", (), {"tags": None})
    run_method(wrapper, "discard", (("weights",),), {})
    assert run_method(wrapper, SLEEP_STATE_METHOD, (), {})["dropped"] == 2
    assert calls == [
        ("sleep", 1), ("wake_up", ["weights"]), ("wake_up", None), ("sleep", 2), ("wake_up", None),
        ("discard", ("weights",)),
    ]  # fmt: skip


def test_the_wrapper_readies_the_online_fingerprints_before_its_worker_loads_the_model():
    register_backends()
    from vllm.model_executor.model_loader import utils

    original = utils.online_quantization_timing_context
    loaded = []

    def load_model(**kwargs):
        loaded.append((kwargs, utils.online_quantization_timing_context is not original))

    wrapper = WorkerWrapperBase.__new__(WorkerWrapperBase)
    wrapper.worker = SimpleNamespace(load_model=load_model)
    try:
        run_method(wrapper, "load_model", (), {"load_dummy_weights": True})
    finally:
        utils.online_quantization_timing_context = original
    assert loaded == [({"load_dummy_weights": True}, True)]
