"""One steady-state push over ``gloo`` traced in a fresh process (``python push_trace_run.py OUT_DIR``; the modules
it enters as JSON on the last line). Run by tests/test_push_path.py; ``push_trace.py`` says why a fresh process.
``Trainer.fit`` pushes after every step into a real in-process ``vllm.LLM``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import TinyCausalLM, build_llm, cpu_trainer, save_model, shutdown, tiny_qwen2, token_batches
from push_trace import TRACED_STEP, ModulesEntered, TracedSync

from lightning_vllm.engines.worker_check import WORKER_EXTENSION


def main(out_dir: Path) -> None:
    model = tiny_qwen2(seed=3)
    # Built so that its pushes are checked, as by default (issue 46): the check is part of a push's path.
    llm = build_llm(save_model(model, out_dir / "model"), worker_extension_cls=WORKER_EXTENSION)
    tracer = ModulesEntered()
    tracer.install()
    try:
        sync = TracedSync(tracer, engine=llm, every_n_train_steps=1, timeout_seconds=60)
        trainer = cpu_trainer(out_dir, [sync], max_steps=TRACED_STEP + 1)
        trainer.fit(TinyCausalLM(model), token_batches(num_batches=TRACED_STEP + 1))
        versions = sync.updater.weight_version
    finally:
        tracer.uninstall()
        shutdown(llm)
    print(
        json.dumps({"modules": sorted(tracer.entered), "calls": sorted(tracer.calls), "versions": versions}), flush=True
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
