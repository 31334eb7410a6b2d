"""A trainer, an NCCL host of its own, that stops for good at a chosen point of a push into ``vllm serve`` over
``nccl`` or ``lightning_nccl``; started by ``test_nccl_nodes.py`` and ``test_lightning_nccl_server.py``, which
SIGKILL it once it is stopped.

``python killed_trainer_run.py SERVER_URL RECORD [POINT] [cpu]``: pushes :data:`LANDED_SEED`'s tiny Qwen2 (it lands;
its version goes to the JSON file ``RECORD``), then :data:`KILLED_SEED`'s, and SIGSTOPs this process at ``POINT`` of
that second push (:data:`POINTS`; ``half-way`` by default):

* ``before-transfer``: vLLM's workers have opened the update (``start_weight_update``); no byte is sent;
* ``half-way``: the source SIGSTOPs the process once half its tensors were read. Small buckets: by then several
  broadcasts of the push are on the wire, and vLLM's workers wait in their receive for the rest;
* ``in-commit``: every byte was sent and generation is paused (with a lease); the call that commits is not made.

Nothing about vLLM is faked: what the test sees after the kill is what a trainer dying there leaves behind.

The trailing ``cpu`` is for debugging this script on a machine without a GPU, against a ``vllm serve`` over ``gloo``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parents[1])]

from helpers import half_way, tiny_qwen2  # noqa: E402

from lightning_vllm import HTTPEngine, VLLMUpdater  # noqa: E402

POINTS = ("before-transfer", "half-way", "in-commit")
"""Where the second push stops (the module docstring)."""
LANDED_SEED = 61
"""The weights of the push that lands, which the server serves when the trainer stops."""
KILLED_SEED = 62
"""The weights of the push the trainer never finishes."""
TIMEOUT_SECONDS = 10.0
"""The trainer's ``timeout_seconds``; the test wants the server serving again within it (plus a few seconds)."""
BUCKET_SIZE_BYTES = 256 << 10


def stop_here() -> None:
    """Stop this process (SIGSTOP) for the test to kill it; its sockets and NCCL communicator stay as they are."""
    print("STOPPING", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


class StoppingHTTPEngine(HTTPEngine):
    """The package's server target, which stops at ``point`` once :attr:`armed` (the second push)."""

    def __init__(self, url: str, point: str) -> None:
        super().__init__(url)
        self.point, self.armed = point, False

    def start_weight_update(self) -> None:
        super().start_weight_update()
        if self.armed and self.point == "before-transfer":
            stop_here()

    def pause_generation(self, mode: Any) -> None:
        super().pause_generation(mode)
        if self.armed and self.point == "in-commit":
            stop_here()


def main(url: str, record: Path, point: str, on_cpu: bool) -> None:
    assert point in POINTS, f"{point!r} is none of {POINTS}"
    device = "cpu" if on_cpu else "cuda"
    engine = StoppingHTTPEngine(url, point)
    updater = VLLMUpdater(engine=engine, timeout_seconds=TIMEOUT_SECONDS, bucket_size_bytes=BUCKET_SIZE_BYTES)
    stats = updater.push_weights(tiny_qwen2(seed=LANDED_SEED).to(device))
    record.write_text(json.dumps({"landed_version": stats.weight_version}))
    print(f"LANDED {stats.weight_version}", flush=True)
    engine.armed = True
    killed = tiny_qwen2(seed=KILLED_SEED).to(device)
    updater.push_weights(half_way(killed, stop_here) if point == "half-way" else killed)
    print("PUSHED", flush=True)  # never reached: the test kills this process first


if __name__ == "__main__":
    on_cpu = sys.argv[-1] == "cpu" and len(sys.argv) > 3
    chosen = sys.argv[3 : len(sys.argv) - on_cpu]
    main(sys.argv[1], Path(sys.argv[2]), chosen[0] if chosen else "half-way", on_cpu)
