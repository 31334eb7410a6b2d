"""How long vLLM's processes spin after a message: a setting the plugin applies in each of them.

vLLM's engine core and its workers talk through shared-memory queues whose readers
busy-wait (``sched_yield`` in a loop) for ``busy_loop_s`` = 1 s after each message
before they fall back to sleeping on a socket (``SpinCondition`` in
``vllm/distributed/device_communicators/shm_broadcast.py``). On a GPU server that
trades a spare core for latency. On a small CPU machine the spinning processes take
the cores the trainer, the transfer and vLLM's own weight loading need. The package's
vLLM plugin (loaded by vLLM in every one of its processes) shortens the spin to
``LIGHTNING_VLLM_BUSY_LOOP_SECONDS`` when that variable is set.
"""

from __future__ import annotations

import os
from typing import Any

BUSY_LOOP_VARIABLE = "LIGHTNING_VLLM_BUSY_LOOP_SECONDS"


def busy_loop_limit() -> float | None:
    """The longest spin asked for by ``LIGHTNING_VLLM_BUSY_LOOP_SECONDS`` (``None``: vLLM's own).

    Raises:
        ValueError: the variable is not a number of seconds >= 0.
    """
    value = os.environ.get(BUSY_LOOP_VARIABLE, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{BUSY_LOOP_VARIABLE}={value!r} is not a number of seconds >= 0 (e.g. 0.002).")
    return seconds


def limit_busy_wait() -> float | None:
    """Cap the spin of every shared-memory queue reader of this process; returns the cap applied.

    The cap is read by each wait, so readers built before the plugin loaded obey it too.
    Calling it again with another value replaces the cap; without the variable nothing changes.
    """
    limit = busy_loop_limit()
    if limit is None:
        return None
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    original = getattr(spin.wait, "__wrapped__", spin.wait)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > limit:
            self.busy_loop_s = limit
        original(self, timeout_ms)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    spin.wait = wait  # type: ignore[method-assign]
    return limit
