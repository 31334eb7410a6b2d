"""``lightning_ipc``'s landed sums: the rows a worker leaves in the trainer's tensor are read as its report once the
push landed, and only the rows of the push that asked for them. Engine-free, on CPU tensors (the CUDA IPC handle
and the worker's event run on the GPU tier: tests/gpu/test_gpu_check.py)."""

from __future__ import annotations

import torch

from lightning_vllm.backends.lightning_ipc.sums_mailbox import SumsMailbox, post_sums
from lightning_vllm.weights.layer_sums import layer_key

NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"]


def rows(*layers_sums: tuple[str, int, int]) -> torch.Tensor:
    return torch.tensor([[layer_key(layer), bits, squares] for layer, bits, squares in layers_sums])


def test_the_rows_left_for_a_push_are_read_as_the_workers_report():
    landed = SumsMailbox(torch.device("cpu"), len(NAMES))
    landed.name(NAMES)
    push = landed.next_push()
    # (A layer the trainer never sent is left out; the squares are read modulo 2**32.)
    left = rows(("model.layers.0.self_attn", 7, 2**32 + 5), ("lm_head", -3, 4), ("model.norm", 1, 1))
    assert post_sums(landed.tensor, push, left)
    assert landed.read() == [
        {
            "sharded": {},
            "replicated": {"model.layers.0.self_attn": [7, 5], "lm_head": [-3, 4]},
            "unverifiable": {},
            "stale": {},
        }
    ]
    assert landed.answered


def test_rows_not_left_for_this_push_are_not_read():
    landed = SumsMailbox(torch.device("cpu"), len(NAMES))
    landed.name(NAMES)
    assert landed.read() is None  # no push asked
    post_sums(landed.tensor, landed.next_push(), rows(("lm_head", 1, 1)))
    landed.read()
    landed.next_push()  # the worker left nothing for this one: the last push's rows are still there
    assert landed.read() is None and not landed.answered
    push = landed.next_push()
    too_many = rows(*[(f"model.layers.{i}.mlp", i, i) for i in range(len(NAMES) + 64 + 1)])
    assert not post_sums(landed.tensor, push, too_many)  # (more rows than the tensor holds: nothing written)
    assert not post_sums(landed.tensor, push, None)  # (no summed replay)
    assert landed.read() is None
