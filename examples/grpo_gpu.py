"""``make demo``'s GRPO on one CUDA GPU: SmolLM2-135M-Instruct learns two-digit addition while an in-process vLLM
engine on the same GPU samples its rollouts, every push over ``lightning_ipc`` and checked.

The task, the reward, the held-out evaluation and the policy-gradient step are ``grpo_addition.py``'s; what differs is
where things run (docs/gpu.md, "Choose a backend"):

- the trainer on the GPU in bf16 mixed precision (float32 weights), the engine beside it in bfloat16, built by the
  callback from ``vllm.LLM`` arguments with ``weight_transfer_config={"backend": "lightning_ipc"}``: each tensor's CUDA
  IPC handle goes once, and the engine loads a push with one batched copy;
- ``--sleep-level 1|2``: vLLM sleeps while the trainer steps (docs/sleep.md);
- ``--fp8``: the engine serves FP8, quantizing the pushed bf16 weights as it loads them (vLLM's online
  ``fp8_per_tensor``: SmolLM2's merged projections cannot be held block-wise, docs/fp8.md);
- ``--engine-gpu N``: the engine on GPU ``N`` instead, placed by ``lightning_vllm.engine_on_gpus``, the trainer on
  GPU 0, every push over ``lightning_nccl`` (NCCL from the trainer's GPU into the engine's, staged and committed
  whole); needs two GPUs.

Run it with ``make demo-gpu``, or::

    python examples/grpo_gpu.py --minutes 8
    python examples/grpo_gpu.py --sleep-level 1 --fp8
    python examples/grpo_gpu.py --engine-gpu 1

The last line is ``heldout_accuracy: before=0.xx after=0.yy steps=N seconds=S``, as ``make demo``'s. Not yet run on a
GPU: issue 68 records it when a GPU is lent.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_addition import (  # noqa: E402
    HELDOUT_SIZE,
    AdditionGRPO,
    HeldOutEvaluation,
    TrainingProblems,
    heldout_problems,
    report,
    save_plot,
    split_pairs,
)
from smollm2 import ModelPreparationError, prepare_smollm2  # noqa: E402

from lightning_vllm import VLLMWeightSync, engine_on_gpus  # noqa: E402

NO_GPU = "grpo_gpu.py needs a CUDA GPU (the engine shares it with the trainer); on CPUs run `make demo`."


def engine_args(model_dir: Path, sleep_level: int | None, fp8: bool, own_gpu: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` arguments for an engine beside the trainer on its GPU: 30 % of the GPU's memory (the trainer and
    its AdamW states take the rest, or the engine sleeps), ``lightning_ipc``, and the options asked for; with
    ``own_gpu``, 85 % of a GPU of its own, ``lightning_nccl``."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "max_model_len": 256,
        "gpu_memory_utilization": 0.85 if own_gpu else 0.3,
        "seed": 0,
        "weight_transfer_config": {"backend": "lightning_nccl" if own_gpu else "lightning_ipc"},
    }
    if sleep_level is not None:
        args["enable_sleep_mode"] = True
    if fp8:
        args["quantization"] = "fp8_per_tensor"
    return args


def main(argv: list[str] | None = None) -> tuple[float, float]:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=8.0, help="stop training after this many minutes")
    parser.add_argument("--steps", type=int, default=400, help="at most this many optimizer steps")
    parser.add_argument("--problems-per-step", type=int, default=32, help="problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="answers sampled per problem")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps")
    parser.add_argument("--sleep-level", type=int, choices=(1, 2), help="vLLM sleeps while the trainer steps")
    parser.add_argument("--fp8", action="store_true", help="the engine serves FP8 (vLLM's online fp8_per_tensor)")
    parser.add_argument("--engine-gpu", type=int, help="the engine on this GPU (the trainer on GPU 0), over NCCL")
    parser.add_argument("--log-dir", default="lightning_logs", help="TensorBoard root folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the sampling")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"error: {NO_GPU}")
    if args.engine_gpu is not None and args.sleep_level is not None:
        parser.error("--sleep-level frees the trainer's GPU of the engine; an engine on a GPU of its own needs none")
    # lightning_ipc hands vLLM's engine core CUDA IPC handles through vLLM's RPC, which carries them only as pickle;
    # the engine core is this run's own child process, on this host (docs/security.md). Set before vLLM starts.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    try:
        model_dir = prepare_smollm2()
    except ModelPreparationError as error:
        sys.exit(f"error: {error}")

    import lightning

    lightning.seed_everything(args.seed, verbose=False)
    train_pairs, heldout = split_pairs(args.seed)
    evaluation = HeldOutEvaluation(heldout_problems(heldout[:HELDOUT_SIZE]), every=args.eval_every)
    module = AdditionGRPO(str(model_dir), group_size=args.group_size, lr=args.lr)
    engine: Any = engine_args(model_dir, args.sleep_level, args.fp8, own_gpu=args.engine_gpu is not None)
    if args.engine_gpu is not None:
        from vllm import LLM

        with engine_on_gpus(args.engine_gpu):  # (the trainer keeps GPU 0; Trainer(devices=[0]) below)
            engine = LLM(**engine)
    sync = VLLMWeightSync(
        engine=engine,
        every_n_train_steps=1,
        max_staleness=0,
        sleep_level=args.sleep_level,
    )
    name = "grpo_gpu" + (f"_sleep{args.sleep_level}" if args.sleep_level else "") + ("_fp8" if args.fp8 else "")
    name += "" if args.engine_gpu is None else "_nccl"
    logger = TensorBoardLogger(args.log_dir, name=name)
    trainer = Trainer(
        max_steps=args.steps,
        max_time={"seconds": args.minutes * 60},
        accelerator="gpu",
        devices=[0],
        precision="bf16-mixed",
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        gradient_clip_val=1.0,
        callbacks=[sync, evaluation],  # evaluation after the push of the same step
    )
    loader = DataLoader(TrainingProblems(train_pairs, args.seed), batch_size=args.problems_per_step, collate_fn=list)
    trainer.fit(module, loader)

    lines = [f"TensorBoard: tensorboard --logdir {args.log_dir}", f"plot: {save_plot(logger.log_dir)}"]
    if (last := sync.updater.last_sync) is not None:
        lines.append(f"last push: version {last.weight_version}, {last.seconds:.3f} s, {last.num_bytes / 1e6:.0f} MB")
    return report(evaluation, trainer, started, lines)


if __name__ == "__main__":
    main()
