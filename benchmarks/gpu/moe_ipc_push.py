"""A 10B bf16 Mixture-of-Experts pushed over lightning_ipc into vLLM's own engine, against one copy of its bytes.

The push and the device-to-device copy it is held against run in the same process on one GPU.

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/moe_ipc_push.py [--rounds 7] [--layers 16] [--checked]

It builds a Qwen3-MoE of Qwen3-30B-A3B's layer shape (``gpu_helpers.QWEN3_30B_A3B_LAYER``: hidden 2048, 128
experts of 768, 8 per token; 16 layers: 10.59B parameters, 21.2 GB) in bf16 on the GPU (random weights), with
its experts fused as transformers 5 holds them, and a real ``vllm.LLM`` of the same shape from dummy weights
(the GPU tier's engine settings). A push sends the experts one tensor per expert and projection (6,291 tensors),
views of the fused ones (``weights/checkpoint_layout.py``). Medians of ``--rounds``, as ``ipc_push.py`` times
them (``push_timeline.py``):

* ``copy``: ``copy_`` of every parameter as the trainer holds it into a buffer of its own (the floor: one copy of
  the bytes); ``sent_tensors_copy``: the same over the tensors a push sends (a ``copy_`` per expert projection);
* ``push``: ``VLLMUpdater.push_weights`` without the check (``verify_pushes=False``, the default), the trainer's
  own tensors handed to the engine; ``--checked``: also with the check after every push.

After the pushes the engine's parameters are read back (float64 sums on its GPU) and must equal the trainer's.
Prints one JSON line (``moe_ipc_push_over_copy``: the push over the copy; the seconds of each, the tensors sent,
the handles the trainer exported, the loads the worker replayed from its recorded copies, the worker's own
``update_weights`` and device time, and where a push's seconds go: ``timeline``, the marks of
``push_timeline.mark_stages``, and ``calls``, the engine calls), writes ``moe_ipc_push.json`` into ``--out``
(default ``$OUT`` or ``.``), and exits 1 if a push did not land exactly.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from figures import options, write_results  # noqa: E402
from push_timeline import (  # noqa: E402
    copy_floor,
    mark_stages,
    push_figures,
    time_control_calls,
    time_workers,
)
from vllm_engine import allow_pickled_rpc  # noqa: E402

BACKEND = "lightning_ipc"


def main() -> None:
    parser = options(__doc__, rounds=7)
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16: 10.59B parameters)")
    parser.add_argument("--checked", action="store_true", help="also push with the check after every push")
    args = parser.parse_args()
    allow_pickled_rpc()  # vLLM's RPC carries the handles as pickle

    from gpu_helpers import dummy_bf16_llm, qwen3_moe_bf16, stop_llm

    from lightning_vllm.weights import weights_from

    model_dir = Path(tempfile.mkdtemp(prefix="qwen3-moe-"))
    model = qwen3_moe_bf16(model_dir, num_hidden_layers=args.layers)
    parameters = [parameter.detach() for parameter in model.parameters()]
    num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in parameters)
    sent = [tensor.detach() for _, tensor in weights_from(model).iter_full()]  # what a push sends: views
    copy_seconds = copy_floor(parameters, args.rounds)
    sent_copy_seconds = copy_floor(sent, args.rounds)
    calls = time_control_calls()
    mark_stages()
    llm = dummy_bf16_llm(model_dir, num_bytes, backend=BACKEND)
    time_workers(llm)
    pushes: dict[str, dict] = {}
    try:
        pushes["unverified_push"] = push_figures(llm, model, BACKEND, args.rounds, calls, verify_pushes=False)
        if args.checked:
            pushes["push"] = push_figures(llm, model, BACKEND, args.rounds, calls, verify_pushes=True)
    finally:
        stop_llm(llm)
    copy, sent_copy = statistics.median(copy_seconds), statistics.median(sent_copy_seconds)
    push = statistics.median(pushes["unverified_push"]["seconds"])
    figures: dict[str, object] = {
        "moe_ipc_push_over_copy": push / copy,
        "moe_ipc_push_seconds": push,
        "copy_seconds": copy,
        "copy_gb_per_second": num_bytes / copy / 1e9,
        "sent_tensors_copy_seconds": sent_copy,
        "moe_ipc_push_over_sent_tensors_copy": push / sent_copy,
        "parameters": sum(tensor.numel() for tensor in parameters),
        "bytes": num_bytes,
        "tensors_held": len(parameters),
        "tensors_sent": len(sent),
        "layers": args.layers,
    }
    if "push" in pushes:
        checked = statistics.median(pushes["push"]["seconds"])
        figures |= {"moe_ipc_checked_push_seconds": checked, "moe_ipc_check_cost_fraction": (checked - push) / push}
    results = {"figures": figures, "copy_seconds_all": copy_seconds, "sent_copy_seconds_all": sent_copy_seconds}
    results |= {f"{BACKEND}_{label}": result for label, result in pushes.items()}
    print(json.dumps({**figures, **pushes}), flush=True)
    write_results(args.out, "moe_ipc_push.json", results)
    if not all(result["landed_exactly"] for result in pushes.values()):
        sys.exit(1)


if __name__ == "__main__":  # vLLM spawns its engine core, which imports this file again
    main()
