"""One steady-state push traced on the trainer's side: the package's modules it enters, from the callback's hook to
the bytes leaving (``python push_trace_run.py OUT_DIR``; the result as JSON on the last line).

Run by tests/test_push_path.py. A fresh process, so that the profile is in every thread the push runs on from
the start (Python 3.11 has no ``sys.monitoring``, and ``threading.setprofile`` reaches only threads started after
it). ``Trainer.fit`` pushes after every step into a real in-process ``vllm.LLM`` over ``gloo``; the first push
connects and the second is the first with a kept choice, so the third is traced: the push of every step after.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from helpers import TinyCausalLM, build_llm, cpu_trainer, save_model, shutdown, tiny_qwen2, token_batches

from lightning_vllm import VLLMWeightSync

TRACED_STEP = 3
recording = threading.Event()
entered: set[str] = set()


def profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and recording.is_set():
        module = frame.f_globals.get("__name__", "")
        if module.startswith("lightning_vllm"):
            entered.add(module)


class TracedSync(VLLMWeightSync):
    """The callback, its push at ``TRACED_STEP`` traced (this module is not the package's, so it is not counted)."""

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == TRACED_STEP:
            recording.set()
        try:
            super().on_train_batch_end(trainer, *args, **kwargs)
        finally:
            recording.clear()


def main(out_dir: Path) -> None:
    model = tiny_qwen2(seed=3)
    llm = build_llm(save_model(model, out_dir / "model"))
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        sync = TracedSync(engine=llm, every_n_train_steps=1, timeout_seconds=60)
        trainer = cpu_trainer(out_dir, [sync], max_steps=TRACED_STEP + 1)
        trainer.fit(TinyCausalLM(model), token_batches(num_batches=TRACED_STEP + 1))
        versions = sync.updater.weight_version
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        shutdown(llm)
    print(json.dumps({"modules": sorted(entered), "versions": versions}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
