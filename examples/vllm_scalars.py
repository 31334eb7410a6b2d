"""What ``VLLMWeightSync`` logs, as TensorBoard shows it: every ``vllm/*`` scalar of a run, one small plot each.

Reads the run's TensorBoard event files (TensorBoard's own reader) and draws each ``vllm/*`` scalar against the
optimizer step, as TensorBoard's Scalars tab would, into one PNG. docs/images/vllm_scalars.png was made this way from a
``make demo-tiny`` run (docs/concepts.md, "What the callback logs")::

    python examples/grpo_tiny.py --log-dir /tmp/tiny
    python examples/vllm_scalars.py /tmp/tiny/grpo_tiny/version_0 docs/images/vllm_scalars.png
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def vllm_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of every ``vllm/*`` scalar logged under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {
        tag: [(point.step, point.value) for point in events.Scalars(tag)]
        for tag in sorted(events.Tags()["scalars"])
        if tag.startswith("vllm/")
    }


def draw(scalars: dict[str, list[tuple[int, float]]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows = max(1, math.ceil(len(scalars) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.4 * rows), squeeze=False)
    for axis, (tag, points) in zip(axes.flat, scalars.items()):
        axis.plot([step for step, _ in points], [value for _, value in points], marker=".", linewidth=1)
        axis.set_title(tag, fontsize=9)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(scalars) :]:
        axis.axis("off")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", help="a run's TensorBoard folder (the logger's log_dir)")
    parser.add_argument("png", type=Path)
    parser.add_argument("--title", default="lightning-vllm: the vllm/* scalars of one run")
    args = parser.parse_args()
    scalars = vllm_scalars(args.log_dir)
    if not scalars:
        raise SystemExit(f"No vllm/* scalars under {args.log_dir}: is it a run's log_dir with VLLMWeightSync?")
    print(draw(scalars, args.png, args.title))


if __name__ == "__main__":
    main()
