"""The methods our plugin gives every vLLM worker, called by name through ``collective_rpc``: the push check.

vLLM runs a method named in ``collective_rpc("name")`` on its ``WorkerWrapperBase``, which hands a name it does not
have to the worker it wraps. Every executor goes through that wrapper: an engine core in the caller's process, one in
a process of its own (``vllm.LLM``'s default), ``AsyncLLM``, Ray workers, and ``vllm serve``'s dev-mode
``/collective_rpc`` route, which passes only a name (nothing is pickled). vLLM's own way to add a method,
``worker_extension_cls``, is a flag the user must remember; the plugin (``plugin.py``), which vLLM loads in each of
its workers before it builds the worker, adds them to the wrapper class instead, so an engine built as the README
shows is checked. A ``worker_extension_cls`` of the user's own still works: vLLM checks an extension's names against
the worker class, not the wrapper.

Each method is named by its qualified name and imported at its first call, as the plugin registers backends: a
worker that is never asked imports nothing of the trainer's side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LAYER_SUMS_METHOD = "lightning_vllm_layer_sums"
"""Each worker's per-layer fingerprints of what it holds (``weights.held_sums.worker_layer_sums``)."""

REPORTS_METHOD = "lightning_vllm_layer_sums_format"
"""What a trainer asks once at connect: whether the workers have :data:`LAYER_SUMS_METHOD`, and in which format."""

LAYER_SUMS_FORMAT = 2
"""The report's format; a trainer that reads another one says so instead of misreading it. 2: fingerprints of
layers vLLM packs (its CPU build) taken where the loader wrote them, and packs built from other values named."""

_LAZY_METHODS = {LAYER_SUMS_METHOD: "lightning_vllm.weights.held_sums.worker_layer_sums"}


def layer_sums_format(worker: Any) -> int:
    """:data:`REPORTS_METHOD`: the format of this worker's reports."""
    return LAYER_SUMS_FORMAT


def install_worker_methods() -> None:
    """Add the methods to vLLM's ``WorkerWrapperBase`` (once: vLLM may load plugins repeatedly in one process)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if REPORTS_METHOD not in WorkerWrapperBase.__dict__:
        setattr(WorkerWrapperBase, REPORTS_METHOD, layer_sums_format)
    for name, qualname in _LAZY_METHODS.items():
        if name not in WorkerWrapperBase.__dict__:
            setattr(WorkerWrapperBase, name, _imported_at_call(name, qualname))


def _imported_at_call(name: str, qualname: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        return resolve_obj_by_qualname(qualname)(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method
