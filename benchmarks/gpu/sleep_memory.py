"""A 1.5B bf16 policy trained with AdamW beside its vLLM engine on one GPU, the engine awake, at level 1 and at level 2
(docs/sleep.md): the GPU memory a training step peaks at, the seconds each sleep and wake takes, and the push after a
weights-only wake against a push into an awake engine, in one run.

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/sleep_memory.py [--rounds 3] [--out DIR]

The policy has Qwen2-1.5B's shape (1.54 B parameters, 3.1 GB in bfloat16; random weights); the engine is a real
``vllm.LLM`` of the same shape from dummy weights over ``lightning_ipc``, built with ``enable_sleep_mode=True`` and
``--utilization`` of the GPU (0.3 by default: its weights and a KV cache of about 20 GB on an H100), the GPU tier's
engine settings otherwise. Each round, per state: the engine is put to sleep (timed), one AdamW step of a batch of
4 x 512 tokens runs (the device's memory in use at its peak: what the engine holds then plus the trainer's peak), the
weights are woken (timed), the policy pushed (``VLLMUpdater.push_weights``, checked, timed), the KV cache woken
(timed). Figures are medians of the rounds, ratios against the awake engine's; the engine's parameters must equal the
trainer's at the end. Prints ``name=value`` lines; writes ``sleep_memory.json`` into ``--out``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from figures import options, print_figures, write_results
from vllm_engine import allow_pickled_rpc, build_model, landed_exactly

QWEN2_1_5B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0,
    tie_word_embeddings=False,
)  # fmt: skip
"""Qwen2-1.5B's shape as a Llama (vLLM serves both with the same layers; untied embeddings, 1.54 B parameters)."""


def device_in_use() -> int:
    """Bytes in use on the whole GPU (every process: the engine's and the trainer's)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> int:
    """One AdamW step of next-token prediction on ``batch``; the GPU's bytes in use at its peak (the other processes'
    as they were when it started, plus this process's peak)."""
    torch.cuda.synchronize()
    others = device_in_use() - torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return others + torch.cuda.max_memory_reserved()


def seconds(fn: Any, *args: Any, **kwargs: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = options(__doc__ or "", rounds=3)
    parser.add_argument("--utilization", type=float, default=0.3, help="the engine's gpu_memory_utilization")
    args = parser.parse_args()
    allow_pickled_rpc()
    from gpu_helpers import gpu_llm

    from lightning_vllm import VLLMUpdater

    model_dir = Path(tempfile.mkdtemp())
    model = build_model(model_dir, QWEN2_1_5B)
    model.train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()  # (the activations of 4 x 512 tokens would dwarf what is compared)
    llm = gpu_llm(
        model_dir, backend="lightning_ipc", dtype="bfloat16", load_format="dummy", enable_sleep_mode=True,
        gpu_memory_utilization=args.utilization, max_model_len=512, max_num_seqs=8,
    )  # fmt: skip
    updater = VLLMUpdater(engine=llm, timeout_seconds=300)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, QWEN2_1_5B["vocab_size"], (4, 512), device="cuda")
    updater.push_weights(model)
    train_step(model, optimizer, batch)  # (AdamW's states are allocated at its first step)
    figures: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    for _ in range(args.rounds):
        for state, level in (("awake", None), ("level1", 1), ("level2", 2)):
            if level is not None:
                note(f"sleep_{state}_seconds", seconds(llm.sleep, level=level))
            note(f"step_peak_{state}_gib", train_step(model, optimizer, batch) / 2**30)
            if level is not None:
                note(f"wake_weights_{state}_seconds", seconds(llm.wake_up, ["weights"]))
            note(f"push_{state}_seconds", seconds(updater.push_weights, model))
            if level is not None:
                note(f"wake_kv_cache_{state}_seconds", seconds(llm.wake_up, ["kv_cache"]))
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)  # (it serves after every state)

    medians = {name: statistics.median(values) for name, values in figures.items()}
    for state in ("level1", "level2"):
        medians[f"step_peak_{state}_over_awake"] = medians[f"step_peak_{state}_gib"] / medians["step_peak_awake_gib"]
        medians[f"push_after_weights_wake_{state}_over_awake"] = (
            medians[f"push_{state}_seconds"] / medians["push_awake_seconds"]
        )
    medians["landed_exactly"] = float(landed_exactly(llm, model))
    print_figures(medians)
    write_results(args.out, "sleep_memory.json", {"figures": medians, "rounds": figures, "args": vars(args) | {
        "out": str(args.out)}})  # fmt: skip


if __name__ == "__main__":
    main()
