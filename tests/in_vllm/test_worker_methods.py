"""The plugin gives vLLM's worker wrapper the check's methods: vLLM's own ``run_method`` finds them by name, on a
worker built without ``worker_extension_cls``, and a user's extension class still mixes in."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.serial_utils import run_method
from vllm.v1.worker.worker_base import WorkerWrapperBase

from lightning_vllm.in_vllm.plugin import register_backends
from lightning_vllm.in_vllm.worker_methods import LAYER_SUMS_FORMAT, LAYER_SUMS_METHOD, REPORTS_METHOD


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
