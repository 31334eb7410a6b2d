"""A trainer, an NCCL host of its own, that stops for good half way through a push into ``vllm serve`` over
``nccl``; started by ``test_nccl_nodes.py``, which SIGKILLs it once it is stopped.

``python killed_trainer_run.py SERVER_URL RECORD [cpu]``: pushes :data:`LANDED_SEED`'s tiny Qwen2 (it lands; its
version goes to the JSON file ``RECORD``), then :data:`KILLED_SEED`'s from a source that SIGSTOPs this process once
half its tensors were read. Small buckets: by then several broadcasts of the push are on the wire, and vLLM's
workers wait in their receive for the rest. Nothing about vLLM is faked: what the test sees after the kill is what a
trainer dying in the middle of a transfer leaves behind.

The trailing ``cpu`` is for debugging this script on a machine without a GPU, against a ``vllm serve`` over ``gloo``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parents[1])]

from helpers import half_way, tiny_qwen2  # noqa: E402

from lightning_vllm import HTTPEngine, VLLMUpdater  # noqa: E402

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


def main(url: str, record: Path, on_cpu: bool) -> None:
    device = "cpu" if on_cpu else "cuda"
    updater = VLLMUpdater(engine=HTTPEngine(url), timeout_seconds=TIMEOUT_SECONDS, bucket_size_bytes=BUCKET_SIZE_BYTES)
    stats = updater.push_weights(tiny_qwen2(seed=LANDED_SEED).to(device))
    record.write_text(json.dumps({"landed_version": stats.weight_version}))
    print(f"LANDED {stats.weight_version}", flush=True)
    updater.push_weights(half_way(tiny_qwen2(seed=KILLED_SEED).to(device), stop_here))
    print("PUSHED", flush=True)  # never reached: the test kills this process first


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), on_cpu=sys.argv[3:] == ["cpu"])
