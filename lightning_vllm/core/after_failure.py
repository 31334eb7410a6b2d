"""What a failed push leaves on an engine, and how it ends before the next push.

vLLM's own engines (``nccl``, ``ipc``) load each chunk as it arrives, inside an update that
``start_weight_update`` opened, with generation paused around it. A push that fails half way
leaves that update open, and vLLM has no abort: :func:`end_failed_update` closes it, then
resumes generation. The engine then reports a mixed version (``"1+2"``: version 1's weights with
what the failed push 2 had loaded) until the next push lands. The connection runs that on a
background thread (the engine may be frozen, and the error must reach the trainer within
``timeout_seconds``); a new connection to the same engine waits for it first (:func:`wait_for`),
so that its first update never meets the end of the old one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

from lightning_vllm._waits import BackgroundCall
from lightning_vllm.engines.base import EngineTarget, NamesItsEngine
from lightning_vllm.engines.client import TimedClient
from lightning_vllm.errors import WeightSyncTimeoutError

log = logging.getLogger(__name__)

# By the engine under the target (engine_key). An entry lives until the next connection to that engine (one
# finished call each).
_RUNNING: dict[Hashable, BackgroundCall[None]] = {}


def engine_key(engine: EngineTarget) -> Hashable:
    """What identifies the vLLM engine under a target (``engines/base.NamesItsEngine``); a target that does not
    name it is an engine of its own."""
    return engine.engine_key() if isinstance(engine, NamesItsEngine) else ("target", id(engine))


def started(engine: EngineTarget, cleanup: BackgroundCall[None]) -> None:
    """Remember ``cleanup``, running for ``engine`` after a failed push, for the next connection to wait for."""
    _RUNNING[engine_key(engine)] = cleanup


def wait_for(engine: EngineTarget, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) for what a failed push left running on ``engine`` to end.

    Raises:
        WeightSyncTimeoutError: it is still running (the engine does not answer).
    """
    cleanup = _RUNNING.get(engine_key(engine))
    if cleanup is None:
        return
    if not cleanup.wait(timeout):
        raise WeightSyncTimeoutError(
            f"{engine.description} has not ended the update a failed push left open after {timeout:g} s: it may be "
            "frozen. Check that it is alive; the next push tries again."
        )
    _RUNNING.pop(engine_key(engine), None)


def end_failed_update(
    client: TimedClient, resume: Callable[[], None], engine: EngineTarget, mixed_version: str | None = None
) -> None:
    """Close the update a failed push left open on vLLM's workers, then resume generation; no version is
    committed. Every call is bounded by the client's timeout; what fails is logged, not raised (the
    push's own error is what the trainer gets).

    ``mixed_version`` (``engines/base.mixed_weight_version``: the version the engine had committed and the failed
    push's) is what the engine reports from then on, when the push had sent it anything to load: its rollouts
    then carry that they come from a mix, never a version whose weights the engine no longer serves whole.

    The worker stays inside the update when the failure came before its ``update_weights`` (the
    trainer's side broke): ``finish_weight_update`` closes it (committing only ``mixed_version``, if given), and
    layer-wise reload puts back the current weights of every layer that received nothing. When its
    ``update_weights`` failed, the worker left the update itself, but the layers it had started
    stay in layer-wise reload (their weights on the meta device, which generation cannot run on):
    one empty update (start, finish) puts them back. Layers that the failed push had sent whole
    keep the new weights, so the engine serves a mix of the two versions until the next push,
    which replaces every weight. An engine known to have died is left alone.
    """
    if engine.is_dead():
        return
    try:
        client.close_open_update(mixed_version)
    except Exception as first:  # noqa: BLE001  # the worker had left the update: put its layers back
        try:
            client.start_weight_update()
            client.close_open_update(mixed_version)
        except Exception as error:  # noqa: BLE001  # gone or frozen: the next connection finds out
            log.warning(
                "Could not close the update a failed push left on %s: %s (first: %s)", engine.description, error, first
            )
    try:
        resume()
    except Exception as error:  # noqa: BLE001
        log.warning("Could not resume generation on %s after a failed push: %s", engine.description, error)
