"""A trainer that pushes into a vLLM server and stops for good at a chosen point of the push.

Run by tests/engines/test_failures.py, which SIGKILLs it once it prints ``STOPPED``:
``python stopped_trainer_run.py URL POINT SEED``. Points:

* ``after-start``: vLLM has opened the update (``start_weight_update``), no byte sent;
* ``mid-transfer``: the workers have posted their receives and the first broadcast is out;
* ``before-commit``: every byte has been sent; generation is not paused yet and the call
  that loads and commits is not made;
* ``in-commit``: generation is paused (with a lease), the call that loads is not made.

The stop is a sleep inside the trainer's own call (nothing about vLLM is faked): what
the test observes is what a real trainer killed at that point leaves behind.
"""

from __future__ import annotations

import sys
import time

from helpers import tiny_qwen2

from lightning_vllm import HTTPEngine, VLLMUpdater
from lightning_vllm.backends.gloo.group import Wire

TIMEOUT_SECONDS = 5.0


def stop_here() -> None:
    print("STOPPED", flush=True)
    time.sleep(3600)  # the test kills this process long before


class StoppingHTTPEngine(HTTPEngine):
    """The package's server target, which stops at the chosen point of a push."""

    def __init__(self, url: str, point: str) -> None:
        super().__init__(url)
        self.point = point

    def start_weight_update(self) -> None:
        super().start_weight_update()
        if self.point == "after-start":
            stop_here()

    def pause_generation(self, mode) -> None:
        if self.point == "before-commit":
            stop_here()
        super().pause_generation(mode)
        if self.point == "in-commit":
            stop_here()


def stop_after_first_broadcast() -> None:
    broadcast = Wire.broadcast  # (in this process, only the trainer's pushes broadcast)

    def broadcast_then_stop(wire, tensor):
        transfer = broadcast(wire, tensor)
        transfer.wait()  # this one is on the wire; the rest never will be
        stop_here()
        return transfer

    Wire.broadcast = broadcast_then_stop  # type: ignore[method-assign]


def main(url: str, point: str, seed: int) -> None:
    if point == "mid-transfer":
        stop_after_first_broadcast()
    # Small buckets: the update takes several broadcasts, so one is a part of it.
    updater = VLLMUpdater(
        engine=StoppingHTTPEngine(url, point), timeout_seconds=TIMEOUT_SECONDS, bucket_size_bytes=256 * 1024
    )
    updater.push_weights(tiny_qwen2(seed=seed))
    print("PUSHED", flush=True)  # never reached: the test fails if it reads this


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
