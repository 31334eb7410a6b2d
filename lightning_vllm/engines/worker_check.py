"""How the trainer reaches the engine's half of the check after every push: each worker's per-layer sums.

Pushes are checked unless the updater is built with ``verify_pushes=False``. Each engine target asks its workers
through ``collective_rpc``, by the names our vLLM plugin gives every worker (``in_vllm/worker_methods.py``): nothing
is pickled, and no flag is needed. At connect it asks once which report format the workers speak
(:func:`layer_sums_problem`): workers that did not load the plugin (``lightning_vllm`` not installed where vLLM
runs, or left out of ``VLLM_PLUGINS``) cannot answer, and pushes to that engine are not checked, said once with
the fix.

``worker_extension_cls`` is no longer needed; :data:`WORKER_EXTENSION` stays so that engines built with it, and
extension classes of users that subclass :class:`WeightCheckExtension`, keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_vllm.in_vllm.worker_methods import LAYER_SUMS_FORMAT, LAYER_SUMS_METHOD, REPORTS_METHOD

__all__ = ["LAYER_SUMS_METHOD", "WORKER_EXTENSION", "WeightCheckExtension", "layer_sums_problem"]

WORKER_EXTENSION = "lightning_vllm.engines.worker_check.WeightCheckExtension"
"""A ``worker_extension_cls`` that engines built before the plugin gave workers the check's methods pass; it adds
nothing now. A class of yours may still subclass it."""


class WeightCheckExtension:
    """A base for worker extensions (``worker_extension_cls``). The check after every push needs none: the plugin
    gives every worker its methods (``in_vllm/worker_methods.py``). Kept so that engines and extensions built with
    it keep working; vLLM takes one extension class, and a class of yours may subclass this one."""


def layer_sums_problem(ask: Callable[[str], Sequence[Any]], description: str) -> str | None:
    """Why the workers of the engine ``description`` cannot be asked for their sums, with the fix (``None``: they
    can). ``ask(method)`` runs ``collective_rpc`` by name on every worker and returns their answers.

    Example::

        >>> layer_sums_problem(lambda method: [LAYER_SUMS_FORMAT, LAYER_SUMS_FORMAT], "in-process vllm.LLM") is None
        True
    """
    try:
        formats = list(ask(REPORTS_METHOD))
    except Exception as error:  # noqa: BLE001  # (vLLM's NotImplementedError, or an HTTP error, or ...: said)
        return (
            f"the {description} engine's workers did not answer {REPORTS_METHOD!r} ({error}): they did not load "
            "lightning_vllm's vLLM plugin, so what they hold after a push cannot be checked. Install lightning_vllm "
            "in the environment vLLM runs in (and, if VLLM_PLUGINS is set there, add 'lightning_vllm_gloo' to it), "
            "or pass verify_pushes=False"
        )
    other = sorted({str(found) for found in formats} - {str(LAYER_SUMS_FORMAT)})
    if other:
        return (
            f"the {description} engine's workers report their sums in format {', '.join(other)}, and this trainer "
            f"reads format {LAYER_SUMS_FORMAT}: install the same lightning_vllm on both sides, or pass "
            "verify_pushes=False"
        )
    return None
