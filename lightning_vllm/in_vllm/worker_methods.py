"""The methods our plugin gives every vLLM worker, called by name through ``collective_rpc``: the push check, and
what the worker's sleep mode did to its weights.

vLLM runs a method named in ``collective_rpc("name")`` on its ``WorkerWrapperBase``, which hands a name it does not
have to the worker it wraps. Every executor goes through that wrapper: an engine core in the caller's process, one in
a process of its own (``vllm.LLM``'s default), ``AsyncLLM``, Ray workers, and ``vllm serve``'s dev-mode
``/collective_rpc`` route, which passes only a name (nothing is pickled). vLLM's own way to add a method,
``worker_extension_cls``, is a flag the user must remember; the plugin (``plugin.py``), which vLLM loads in each of
its workers before it builds the worker, adds them to the wrapper class instead, so an engine built as the README
shows is checked. A ``worker_extension_cls`` of the user's own still works: vLLM checks an extension's names against
the worker class, not the wrapper.

The wrapper's ``load_model`` (the executors call it on the wrapper) first readies the check's fingerprints of
layers vLLM quantizes online (``weights/online_sums.py``), then hands the call to the worker.

Each method is named by its qualified name and imported at its first call, as the plugin registers backends: a
worker imports nothing of the trainer's side, and of the check's engine half only ``online_sums.py`` (with the sums it
takes) until it is asked for a report.

Sleep mode: vLLM's executor calls its workers' ``sleep``, ``wake_up`` and ``discard`` by name through the same
wrapper, whoever asked (our callback, the user's ``llm.sleep()``, a server's ``/sleep`` route). The wrapper's own
:func:`sleep` and friends hand each call to the worker and note what it left asleep and whether the weights were
dropped (level 2, or a discard); :data:`SLEEP_STATE_METHOD` answers with that. vLLM itself reports only "sleeping or
not" and keeps reporting the last version after a level-2 sleep, whose weights are gone: a push must then send every
layer, and nothing may be generated before it lands (``engines/sleep.py``).
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
layers vLLM packs (its CPU build) taken where the loader wrote them, and packs built from other values named.
Layers vLLM quantizes online are reported by what they were quantized from (``weights/online_sums.py``), within it."""

_BEFORE_LOAD = "lightning_vllm.weights.online_sums.fingerprinting_online_quantization"
"""Run in the worker before vLLM loads the model: the check's fingerprints of layers vLLM quantizes online."""

SLEEP_STATE_METHOD = "lightning_vllm_sleep_state"
"""What the worker's sleep mode left: ``{"asleep": [tags], "level": last sleep level, "dropped": times the weights
were dropped}`` (:func:`sleep_state`)."""

_LAZY_METHODS = {LAYER_SUMS_METHOD: "lightning_vllm.weights.held_sums.worker_layer_sums"}


def layer_sums_format(worker: Any) -> int:
    """:data:`REPORTS_METHOD`: the format of this worker's reports."""
    return LAYER_SUMS_FORMAT


def _noted(wrapper: Any) -> dict[str, Any]:
    noted: dict[str, Any] | None = wrapper.__dict__.get("_lightning_vllm_sleep")
    if noted is None:
        noted = wrapper.__dict__["_lightning_vllm_sleep"] = {"asleep": set(), "level": 0, "dropped": 0}
    return noted


def sleep(wrapper: Any, level: int = 1) -> Any:
    """The worker's ``sleep``, noted: level 1 keeps a host copy of the weights, level 2 drops them."""
    result = wrapper.worker.sleep(level)
    noted = _noted(wrapper)
    noted["asleep"] |= {"weights", "kv_cache"}
    noted["level"] = level
    noted["dropped"] += level >= 2
    return result


def wake_up(wrapper: Any, tags: list[str] | None = None) -> Any:
    """The worker's ``wake_up``, noted (``None``: every tag)."""
    result = wrapper.worker.wake_up(tags)
    noted = _noted(wrapper)
    noted["asleep"] = set() if tags is None else noted["asleep"] - set(tags)
    return result


def discard(wrapper: Any, tags: tuple[str, ...]) -> Any:
    """The worker's ``discard`` (vLLM 0.33): the tags' memory is released without a copy, as at level 2."""
    result = wrapper.worker.discard(tags)
    noted = _noted(wrapper)
    noted["asleep"] |= set(tags)
    noted["dropped"] += "weights" in tags
    return result


def sleep_state(wrapper: Any) -> dict[str, Any]:
    """:data:`SLEEP_STATE_METHOD`: what sleep mode left on this worker, as plain data (a server's route sends JSON)."""
    noted = _noted(wrapper)
    return {"asleep": sorted(noted["asleep"]), "level": noted["level"], "dropped": noted["dropped"]}


def load_model(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    """The worker's ``load_model``, after :data:`_BEFORE_LOAD` (imported here: only a worker that loads runs it)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    resolve_obj_by_qualname(_BEFORE_LOAD)()
    return wrapper.worker.load_model(*args, **kwargs)


def install_worker_methods() -> None:
    """Add the methods to vLLM's ``WorkerWrapperBase`` (once: vLLM may load plugins repeatedly in one process)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if REPORTS_METHOD not in WorkerWrapperBase.__dict__:
        setattr(WorkerWrapperBase, REPORTS_METHOD, layer_sums_format)
    # (The wrapper hands names it lacks to its worker; these three it now has, and they hand on the same call.)
    for name, method in (
        ("sleep", sleep),
        ("wake_up", wake_up),
        ("discard", discard),
        (SLEEP_STATE_METHOD, sleep_state),
        ("load_model", load_model),
    ):
        if name not in WorkerWrapperBase.__dict__:
            setattr(WorkerWrapperBase, name, method)
    for name, qualname in _LAZY_METHODS.items():
        if name not in WorkerWrapperBase.__dict__:
            setattr(WorkerWrapperBase, name, _imported_at_call(name, qualname))


def _imported_at_call(name: str, qualname: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        return resolve_obj_by_qualname(qualname)(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method
