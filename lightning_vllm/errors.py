"""Exceptions raised by lightning-vllm.

Every error says what went wrong and how to fix it. They subclass the built-in
exception a caller would otherwise catch (``ValueError`` for bad input,
``TimeoutError`` for a wait that ran out), so existing ``except`` clauses keep
working.
"""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync with vLLM failed; the message names the cause and the fix."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A wait for vLLM (rendezvous, transfer or control call) ran out of time."""


class EngineConfigError(WeightSyncError, ValueError):
    """The vLLM engine is not set up for the weight sync that was asked for."""


class WeightsMismatchError(WeightSyncError, ValueError):
    """The weights offered do not fit the engine's model (names, shapes or dtypes)."""


class LandedWeightsMismatchError(WeightsMismatchError):
    """A push committed, but what an engine now holds differs from what was sent (the check after
    every push, ``verify_pushes``).

    Attributes:
        stats: the push's figures (``SyncStats``).
        layers: ``{engine index: [layer, ...]}``: the layers that differ in each engine.
    """

    def __init__(self, message: str, stats: object, layers: dict[int, list[str]]) -> None:
        super().__init__(message)
        self.stats = stats
        self.layers = layers


class StaleRolloutsError(WeightSyncError, ValueError):
    """Rollouts came from weights older than the callback's ``max_staleness`` allows."""


class EngineBusyError(WeightSyncError):
    """The engine refused a request for now (vLLM 0.33 refuses new requests while generation is
    paused for a weight update, HTTP 503); the same request succeeds once it resumes."""


class EngineDeadError(WeightSyncError):
    """The vLLM engine (its process, server or actor) died; it must be restarted."""


class PushAborted(WeightSyncError):
    """Another trainer rank failed during a push every rank takes part in; the message is its error."""


class PartialPushError(WeightSyncError):
    """A push reached some engines and failed on others.

    The engines that took it serve the new version, which is committed (a version never
    names two sets of weights); the others keep their previous weights and report their
    own version on their rollouts. ``stats`` holds the push's figures and
    ``failures`` each failed engine's error, by worker id.
    """

    def __init__(self, message: str, stats: object, failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.stats = stats
        self.failures = failures
