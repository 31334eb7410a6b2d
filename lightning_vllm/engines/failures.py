"""How an engine fails a request, told apart: dead, frozen for now (paused), or not at all.

The exceptions of vLLM and Ray that mean an engine is gone are read here, in one place.
"""

from __future__ import annotations

import sys

from lightning_vllm.engines.base import EngineTarget
from lightning_vllm.errors import EngineBusyError, EngineDeadError, PushAborted


def raise_if_dead(engine: EngineTarget) -> None:
    """Raise :class:`EngineDeadError` if ``engine`` is known to have died (asked while a generate waits)."""
    if engine.is_dead():
        raise EngineDeadError(
            f"{engine.description} has died (its engine-core process exited). Restart it; the next push "
            "re-joins an engine that is back."
        )


def engine_death(error: BaseException, engine: EngineTarget, during: str) -> EngineDeadError | None:
    """The :class:`EngineDeadError` to raise for ``error`` if it says ``engine`` is gone, or ``engine`` is known to
    have died, else None. The second because vLLM's client, once it saw its engine core exit, closes its sockets, and
    a call racing that fails with what the closed socket raises (``ZMQError: Socket operation on non-socket``, seen
    in ``tests/fronts/lightning/test_ranks.py``'s killed engine) rather than with vLLM's ``EngineDeadError``. An
    interrupt, or another trainer rank's failure (``PushAborted``), stays what it is."""
    known_dead = isinstance(error, Exception) and not isinstance(error, PushAborted) and engine.is_dead()
    if not (is_engine_death(error) or known_dead):
        return None
    first_line = next(iter(str(error).splitlines()), "")
    return EngineDeadError(
        f"{engine.description} died {during} ({type(error).__name__}: {first_line}). Start a new "
        "engine and hand it to the updater (VLLMWeightSync.updater.set_engine), or restart it where it was: the "
        "next push joins an engine that is back."
    )


def is_paused_refusal(error: BaseException) -> bool:
    """Whether ``error`` is an engine's refusal to take a request while generation is paused."""
    from vllm.exceptions import RetryableRequestError

    return isinstance(error, (RetryableRequestError, EngineBusyError))


def retry_delay(attempt: int) -> float:
    """Seconds to wait before asking a paused engine again: doubling from 10 ms, at most 0.5 s."""
    return min(0.01 * 2**attempt, 0.5)


def is_engine_death(error: BaseException) -> bool:
    """Whether ``error`` says the engine itself is gone (vLLM's engine core, a Ray actor)."""
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

    if isinstance(error, VLLMEngineDeadError):
        return True
    if "ray" in sys.modules:
        from ray.exceptions import RayActorError

        return isinstance(error, RayActorError)
    return False
