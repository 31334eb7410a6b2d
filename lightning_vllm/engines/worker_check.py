"""The engine's half of the check after every push: each vLLM worker sums what it holds, per layer.

Pushes are checked unless the updater is built with ``verify_pushes=False``. The trainer reaches the
workers through ``collective_rpc``. By name, the method must be on the
worker, which vLLM's ``worker_extension_cls`` arranges (no pickle crosses the wire)::

    LLM(model=..., weight_transfer_config={"backend": "gloo"}, worker_extension_cls=WORKER_EXTENSION)

(``--worker-extension-cls`` for ``vllm serve``). Without it, an engine whose RPCs may carry a
function (an engine core in the trainer's process, or ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
which the ``ipc`` backend needs anyway) is sent :func:`layer_sums_of_worker` itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning_vllm.engines.serialization import INSECURE_SERIALIZATION, flag_set, started_without_pickle
from lightning_vllm.weights.layer_sums import held_layer_sums

LAYER_SUMS_METHOD = "lightning_vllm_layer_sums"
"""The worker method :class:`WeightCheckExtension` adds, called by name through ``collective_rpc``."""

WORKER_EXTENSION = "lightning_vllm.engines.worker_check.WeightCheckExtension"
"""What to pass as ``worker_extension_cls`` so that every push can be checked."""


class WeightCheckExtension:
    """vLLM mixes this class into its worker (``worker_extension_cls``): the trainer asks each worker
    for the per-layer sums of the weights it holds (``weights/layer_sums.py``). Subclass it to add
    worker methods of your own; vLLM takes one extension class."""

    def lightning_vllm_layer_sums(self) -> dict[str, dict[str, Any]]:
        """Per-layer fingerprints of this worker's model (its shard under tensor parallelism)."""
        return held_layer_sums(self.get_model())  # type: ignore[attr-defined]  # vLLM's worker has it


def layer_sums_of_worker(worker: Any) -> dict[str, dict[str, Any]]:
    """:meth:`WeightCheckExtension.lightning_vllm_layer_sums` for a worker without the extension
    (sent as a function, where the engine's RPCs may carry one)."""
    return held_layer_sums(worker.get_model())


def has_extension(extension_qualname: str | None) -> bool:
    """Whether ``worker_extension_cls`` names a class that has the layer-sums method."""
    if not extension_qualname:
        return False
    from vllm.utils.import_utils import resolve_obj_by_qualname

    try:
        return hasattr(resolve_obj_by_qualname(extension_qualname), LAYER_SUMS_METHOD)
    except (ImportError, AttributeError, ValueError):
        return False


def rpc_for(vllm_config: Any, engine_core: Any) -> str | Callable[[Any], Any] | None:
    """What an in-process ``vllm.LLM``/``AsyncLLM`` is asked through ``collective_rpc`` for the sums: the
    extension's method name, else the function itself where its RPCs may carry one, else ``None``."""
    if has_extension(getattr(vllm_config.parallel_config, "worker_extension_cls", None)):
        return LAYER_SUMS_METHOD
    in_process = getattr(engine_core, "_send_input", None) is None
    # A function crosses a multiprocess core's RPC pickled: this process must encode it, and the core must have
    # started able to decode it, or its input thread stops (seen on an H200: the engine then answered nothing).
    if in_process or (flag_set(os.environ.get(INSECURE_SERIALIZATION)) and started_without_pickle(engine_core) is None):
        return layer_sums_of_worker
    return None


def missing_extension(description: str) -> str:
    """Why an engine's workers cannot be asked for their sums, and the fix."""
    return (
        f"the {description} engine's workers were built without lightning_vllm's worker extension, so what they "
        f"hold after a push cannot be checked. Build the engine with worker_extension_cls={WORKER_EXTENSION!r} "
        "(vllm serve: --worker-extension-cls; a class of yours may subclass it), or pass verify_pushes=False"
    )
