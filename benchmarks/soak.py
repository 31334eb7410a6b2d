"""Soak: many pushes in a row, and what they leave behind (``make soak``).

Pushes a tiny model again and again into an in-process ``vllm.LLM`` and into a
``vllm serve`` subprocess, and measures, after a warm-up and at the end, the resident
memory of the trainer and of the engine's processes, the trainer's threads and the open
file descriptors of both. Passes when memory grew by at most 5 %, threads and file
descriptors did not grow, and the engine serves the last pushed weights (prompt logprobs
within 1e-4)::

    python benchmarks/soak.py                 # 1000 pushes in process, 300 through vllm serve
    python benchmarks/soak.py --local 50 --server 0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

MAX_RSS_GROWTH = 0.05


@dataclass
class Footprint:
    """What one moment of a soak leaves: memory, threads and file descriptors."""

    trainer_rss: int
    engine_rss: int
    trainer_threads: int
    trainer_fds: int
    engine_fds: int

    @classmethod
    def now(cls, engine_pids: list[int]) -> Footprint:
        me = psutil.Process()
        engine = [psutil.Process(pid) for pid in engine_pids]
        # A helper thread of the last push may still be ending: the fewest of a few samples.
        samples = []
        for _ in range(5):
            samples.append((me.num_threads(), me.num_fds(), sum(process.num_fds() for process in engine)))
            time.sleep(0.1)
        threads, trainer_fds, engine_fds = (min(column) for column in zip(*samples))
        return cls(
            trainer_rss=me.memory_info().rss,
            engine_rss=sum(process.memory_info().rss for process in engine),
            trainer_threads=threads,
            trainer_fds=trainer_fds,
            engine_fds=engine_fds,
        )


@dataclass
class SoakReport:
    """A soak's footprints after the warm-up and at the end, and the final logprob gap."""

    name: str
    pushes: int
    seconds: float
    warm: Footprint
    end: Footprint
    logprob_gap: float

    def rss_growth(self, which: str) -> float:
        before, after = getattr(self.warm, which), getattr(self.end, which)
        return (after - before) / before

    def failures(self) -> list[str]:
        """What broke the soak's limits (empty: it passed)."""
        failures = []
        for which in ("trainer_rss", "engine_rss"):
            if self.rss_growth(which) > MAX_RSS_GROWTH:
                failures.append(f"{which} grew by {self.rss_growth(which):.1%}")
        for which in ("trainer_threads", "trainer_fds", "engine_fds"):
            if getattr(self.end, which) > getattr(self.warm, which):
                failures.append(f"{which}: {getattr(self.warm, which)} -> {getattr(self.end, which)}")
        if not self.logprob_gap < 1e-4:
            failures.append(f"final logprobs differ by {self.logprob_gap:.2e}")
        return failures

    def line(self) -> str:
        return (
            f"{self.name}: {self.pushes} pushes in {self.seconds:.0f} s; trainer RSS "
            f"{self.warm.trainer_rss / 2**20:.0f} -> {self.end.trainer_rss / 2**20:.0f} MiB "
            f"({self.rss_growth('trainer_rss'):+.1%}), engine RSS {self.warm.engine_rss / 2**20:.0f} -> "
            f"{self.end.engine_rss / 2**20:.0f} MiB ({self.rss_growth('engine_rss'):+.1%}), trainer threads "
            f"{self.warm.trainer_threads} -> {self.end.trainer_threads}, fds trainer {self.warm.trainer_fds} -> "
            f"{self.end.trainer_fds}, engine {self.warm.engine_fds} -> {self.end.engine_fds}; final logprob gap "
            f"{self.logprob_gap:.1e}"
        )


def engine_processes(root_pid: int) -> list[int]:
    """``root_pid`` (an engine core, or the server) and every process below it (workers)."""
    return [root_pid, *(child.pid for child in psutil.Process(root_pid).children(recursive=True))]


def soak(name: str, engine, engine_pids: list[int], pushes: int, warmup: int | None = None) -> SoakReport:
    """Push ``pushes`` times into ``engine`` with one updater (the model changes a little each
    time, as training does), and measure the footprint after ``warmup`` pushes and at the end."""
    from helpers import hf_prompt_logprobs, max_abs_diff, served_logprobs, tiny_qwen2

    from lightning_vllm import VLLMUpdater

    warmup = warmup if warmup is not None else max(5, pushes // 10)
    model = tiny_qwen2(seed=7)
    updater = VLLMUpdater(engine=engine, timeout_seconds=60)
    start = time.perf_counter()
    warm = Footprint.now(engine_pids)
    for push in range(pushes):
        with torch.no_grad():
            model.lm_head.weight.add_(1e-3)
        updater.push_weights(model)
        if push + 1 == warmup:
            warm = Footprint.now(engine_pids)
    end = Footprint.now(engine_pids)
    seconds = time.perf_counter() - start
    updater.close()
    gap = max_abs_diff(served_logprobs(engine), hf_prompt_logprobs(model.eval()))
    return SoakReport(name, pushes, seconds, warm, end, gap)


def soak_local(pushes: int, model_dir: Path) -> SoakReport:
    from helpers import build_llm, shutdown

    llm = build_llm(model_dir)
    try:
        core = llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
        return soak("in-process vllm.LLM", llm, engine_processes(core), pushes)
    finally:
        shutdown(llm)


def soak_server(pushes: int, model_dir: Path, log_dir: Path) -> SoakReport:
    from helpers import VLLMServer, save_tokenizer

    from lightning_vllm import HTTPEngine

    save_tokenizer(model_dir)
    server = VLLMServer(model_dir, log_dir / "server.log")
    try:
        server.wait_until_healthy()
        return soak("vllm serve", HTTPEngine(server.url), engine_processes(server.process.pid), pushes)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, default=1000, help="pushes into an in-process vllm.LLM")
    parser.add_argument("--server", type=int, default=300, help="pushes through vllm serve")
    args = parser.parse_args()
    from helpers import save_model, tiny_qwen2

    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(tiny_qwen2(seed=0), Path(tmp) / "model")
        if args.local:
            reports.append(soak_local(args.local, model_dir))
            print(reports[-1].line(), flush=True)
        if args.server:
            reports.append(soak_server(args.server, model_dir, Path(tmp)))
            print(reports[-1].line(), flush=True)
    failures = [f"{report.name}: {failure}" for report in reports for failure in report.failures()]
    print("soak: " + ("passed" if not failures else "FAILED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
