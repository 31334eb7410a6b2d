"""The check's GPU sums (``weights/gpu_sums.py``) against one copy, for spans of several shapes, on an 8B-shaped bf16
model's tensors (Llama-3-8B, random values, on the GPU alone: no engine).

On the GPU host, with ``.gpu-carry`` beside the checkout (``make gpu-carry`` here)::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/sums_spans.py [--out DIR]

Times, as medians of ``--rounds``: ``copy`` (``copy_`` of every tensor into a buffer of its own); for each span shape
(``BLOCKxSTEPS``: a program reads ``STEPS`` blocks of ``BLOCK`` values), the trainer's half (``batched_sums``: one
read of every tensor) and the engine's (``SummedCopies``: the copies that sum what they write), and both over the
copy. The shape in ``gpu_sums.py`` is the one these figures chose (2026-12-07). Prints ``name=value`` lines; writes
``sums_spans.json`` into ``--out``.
"""

from __future__ import annotations

import statistics

import torch
from figures import options, print_figures, timed, write_results

SHAPES = ((1024, 16), (1024, 64), (2048, 16), (4096, 8), (512, 32))
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 4096, 14336, 32, 128256, 1024


def main() -> None:
    args = options(__doc__, rounds=7).parse_args()
    from lightning_vllm.weights import gpu_sums
    from lightning_vllm.weights.layer_sums import sums_as_ints

    layer = ((HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
    shapes = [(VOCAB, HIDDEN), *(s for _ in range(LAYERS) for s in (*layer, (HIDDEN,), (HIDDEN,))), (HIDDEN,)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    sources = [torch.empty(s, dtype=torch.bfloat16, device="cuda").normal_(generator=generator) for s in shapes]
    sources.append(torch.empty_like(sources[0]).normal_(generator=generator))  # (an untied head)
    destinations = [torch.empty_like(t) for t in sources]
    figures = {"bytes": float(sum(t.numel() * t.element_size() for t in sources))}
    copy = statistics.median(timed(lambda: [d.copy_(s) for d, s in zip(destinations, sources)], args.rounds))
    figures["copy_seconds"] = copy
    copies = [(d.view(-1), s.view(-1), owner) for owner, (d, s) in enumerate(zip(destinations, sources))]
    reference = None
    for block, steps in SHAPES:
        gpu_sums._BLOCK, gpu_sums._STEPS = block, steps  # (read at each launch: the tables are built anew below)
        gpu_sums._layouts.clear()
        summed = gpu_sums.SummedCopies(copies, len(copies))
        sums = sums_as_ints(gpu_sums.batched_sums(sources))
        if reference is None:
            reference = sums
        assert sums == reference == sums_as_ints(summed.run()), f"{block}x{steps}: the sums differ"
        read = statistics.median(timed(lambda: gpu_sums.batched_sums(sources), args.rounds))
        written = statistics.median(timed(summed.run, args.rounds))
        figures[f"sums_{block}x{steps}_seconds"] = read
        figures[f"summed_copies_{block}x{steps}_seconds"] = written
        figures[f"sums_{block}x{steps}_over_copy"] = read / copy
        figures[f"summed_copies_{block}x{steps}_over_copy"] = written / copy
    print_figures(figures)
    write_results(args.out, "sums_spans.json", {"figures": figures})


if __name__ == "__main__":
    main()
