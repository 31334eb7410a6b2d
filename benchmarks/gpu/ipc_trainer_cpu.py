"""The trainer's side of a kept ``lightning_ipc`` push, timed on CPU: what is left of a push above its copy.

On the GPU host an 8B push over ``lightning_ipc`` is the worker's copy plus the trainer's Python and
vLLM's RPC (``ipc_push.py``, docs/runs.md). That host's CPU is not steady from one call to the next, and
device time is scarce, so this script times the trainer's part here, as a stand-in:

* a Llama with the 8B model's 291 tensors (32 layers) but tiny dimensions, on CPU;
* ``VLLMUpdater`` with ``backend="lightning_ipc"``, our trainer engine
  (``backends/lightning_ipc/trainer.py``), its CUDA calls replaced: a handle is the tensor's address, and the
  worker's copies are done at once;
* an engine target that takes the update in one call and generates only inside its calls, as the
  in-process ``vllm.LLM`` does (``engines/local.py``), but loads nothing.

It prints the median and best push of ``--rounds``, unchecked (``changed_only=False``, as
``ipc_push.py``); with ``--profile``, the main thread's profile. Run from the project root:
``.venv/bin/python benchmarks/gpu/ipc_trainer_cpu.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "core")]

import torch  # noqa: E402
from figures import wall_seconds  # noqa: E402
from test_connection_gpu_backends import GPUEngine  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from lightning_vllm import VLLMUpdater  # noqa: E402
from lightning_vllm.backends import base as backends_base  # noqa: E402
from lightning_vllm.backends.lightning_ipc import trainer as ipc_trainer  # noqa: E402
from lightning_vllm.engines.base import GeneratesOnlyInCalls, UpdatesInOneCall  # noqa: E402


class LandedAtOnce:
    """Stands in for the trainer's interprocess CUDA event: the worker's copies are done at once."""

    def __init__(self, interprocess: bool = False) -> None: ...

    def ipc_handle(self) -> bytes:
        return b"event"

    def query(self) -> bool:
        return True


class NoStream:
    def synchronize(self) -> None: ...


def replace_cuda() -> None:
    """The CUDA calls a push makes, replaced (this script's process only)."""
    torch.cuda.is_available = lambda: True
    torch.cuda.Event = LandedAtOnce  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: NoStream()  # type: ignore[assignment,return-value]
    torch.cuda.get_device_properties = lambda index: type("Props", (), {"uuid": "GPU-0"})()  # type: ignore[assignment]
    torch.cuda.ipc_collect = lambda: None
    torch.cuda.device = lambda device: contextlib.nullcontext()  # type: ignore[assignment,misc]
    torch.accelerator.current_device_index = lambda: 0
    ipc_trainer.reduce_tensor = lambda tensor: (None, ("handle", tensor.data_ptr()))  # type: ignore[assignment]
    backends_base.Backend.sender_device = lambda self: torch.device("cpu")  # type: ignore[method-assign]


class InProcessEngine(GPUEngine, GeneratesOnlyInCalls, UpdatesInOneCall):
    """An engine built with ``lightning_ipc`` that takes the update in one call, as an in-process ``vllm.LLM``."""

    def generates_only_in_calls(self) -> bool:
        return True

    def update_weights_in_one_call(
        self, update_on_worker: Callable[..., None], update_info: dict[str, Any], weight_version: str | None
    ) -> None:
        self.start_weight_update()
        self.finish_weight_update(weight_version)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.active = False
        if weight_version is not None:
            self.version = weight_version

    def reset_prefix_cache(self) -> None: ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="also print the main thread's profile")
    args = parser.parse_args()
    replace_cuda()
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    engine = InProcessEngine(model, "lightning_ipc")
    updater = VLLMUpdater(engine=engine, timeout_seconds=30, changed_only=False)
    updater.push_weights(model)  # joins; the next push keeps every slot
    updater.push_weights(model)
    seconds = wall_seconds(lambda: updater.push_weights(model), args.rounds)
    tensors = len(list(model.parameters()))
    print(f"tensors={tensors}")
    print(f"push_median_seconds={statistics.median(seconds):.6f}")
    print(f"push_best_seconds={min(seconds):.6f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            updater.push_weights(model)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        print(text.getvalue())
    updater.close()


if __name__ == "__main__":
    main()
