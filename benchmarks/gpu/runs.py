"""GPU runs of lightning_vllm's public API against vLLM 0.33's weight-transfer engines and a Hugging Face receiver.

From the project root on the 2 x H200 host::

    source .gpu-carry/setup.sh && python3 benchmarks/gpu/runs.py --all

or one run: ``python3 benchmarks/gpu/runs.py nccl`` (see ``--help``). Each run prints one JSON
line of its figures (``"ok": false`` and exit code 1 when a check failed). Every run goes in a
session of its own, killed with all it started (receivers, re-launched ranks) after its limit;
its log is ``$OUT/gpu_logs/<run>.log`` (``/tmp/gpu_logs`` without ``OUT``). ``--all`` runs them
all within ``--budget`` seconds and writes ``$OUT/gpu_results.json`` when ``OUT`` is set.
``--cpu`` is a dry run on CPU (tiny models, lightning_vllm's gloo backend instead of vLLM's, no
raw NCCL floor) to debug this script without a GPU; its figures mean nothing.

The receiver runs vLLM's worker-side transfer engines into a Hugging Face model, not vLLM's model
runner; on the host NCCL is 2.28.9 with vLLM's suspend/resume symbols skipped (see README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Our modules, the CPU benchmarks' (training.py, models.py), and lightning_vllm (also for re-launched ranks).
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from engine import ReceiverEngine  # noqa: E402
from hf_models import MODELS, build_model, mismatches, model_digests  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from models import fully_shard_layers  # noqa: E402
from nccl_floor import MASTER_ADDRESS, timed_broadcasts  # noqa: E402
from training import MetricsInMemory, quiet_trainer  # noqa: E402

from lightning_vllm import VLLMUpdater, VLLMWeightSync  # noqa: E402


@dataclass(frozen=True)
class Profile:
    """Where and how big: the GPU host, or a CPU dry run."""

    gpu: bool
    small: str  # model of the training runs
    large: str  # model of the throughput runs
    steps: int
    batch: int
    seq: int

    def device(self, index: int) -> str:
        return f"cuda:{index}" if self.gpu else "cpu"

    def backend(self, backend: str) -> str:
        return backend if self.gpu else "gloo"  # vLLM's nccl/ipc engines need CUDA


GPU = Profile(gpu=True, small="qwen2-1.5b", large="llama3-8b", steps=6, batch=4, seq=256)
CPU = Profile(gpu=False, small="qwen2-tiny", large="llama-tiny", steps=3, batch=2, seq=16)


# -- the training side ----------------------------------------------------------------


class Policy(pl.LightningModule):
    """A Hugging Face causal LM trained on random tokens; sharded with FSDP2 when ``fsdp``."""

    def __init__(self, model_name: str, fsdp: bool = False, seed: int = 0, lr: float = 1e-3) -> None:
        super().__init__()
        self.config = MODELS[model_name]()
        self.fsdp, self.seed, self.lr = fsdp, seed, lr
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = build_model(self.config, self.trainer.strategy.root_device, self.seed)
        if self.fsdp:
            fully_shard_layers(self.model, self.device_mesh["data_parallel"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # AdamW moves every bfloat16 weight each step, so a receiver one push behind cannot pass the check.
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def token_batches(profile: Profile, vocab_size: int, steps: int) -> torch.utils.data.DataLoader:
    tokens = torch.randint(0, vocab_size, (2 * steps * profile.batch, profile.seq), generator=torch.Generator())
    return torch.utils.data.DataLoader(tokens, batch_size=profile.batch)  # twice the steps: a rank of two sees half


def make_trainer(
    profile: Profile,
    gpus: list[int],
    callbacks: list[Callback],
    steps: int,
    strategy: Any = "auto",
    logger: Logger | None = None,
) -> pl.Trainer:
    return quiet_trainer(
        accelerator="gpu" if profile.gpu else "cpu",
        devices=gpus if profile.gpu else len(gpus),
        strategy=strategy,
        precision="bf16-true",
        max_steps=steps,
        callbacks=callbacks,
        logger=logger or False,
        num_sanity_val_steps=0,
    )


def fsdp2(gpus: list[int]) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=len(gpus), tensor_parallel_size=1)


def local_rank() -> int:
    """This process's rank: Lightning re-launches this script for ranks > 0 with LOCAL_RANK set."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PushCheck(Callback):
    """Placed after a ``VLLMWeightSync``: after each of its pushes (or once, at the end of fitting),
    the receiver holds the trainer's weights bit for bit, under the version the trainer pushed.

    With ``check_first`` it first checks the opposite (before any push the receiver's own random
    weights differ), so a check that cannot fail is caught. Every rank gathers sharded weights
    (a collective); rank 0 compares.
    """

    def __init__(
        self, sync: VLLMWeightSync, engine: ReceiverEngine | None, per_push: bool = True, check_first: bool = True
    ) -> None:
        self.sync, self.engine, self.per_push, self.check_first = sync, engine, per_push, check_first
        self.records: list[dict[str, Any]] = []
        self.differs_before_first_push: bool | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.check_first:
            return
        ours = model_digests(pl_module.model)
        if self.engine is not None:
            # Norms (ones) and biases (zeros) start equal; random weights must not.
            self.differs_before_first_push = bool(mismatches(ours, self.engine.checksum()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Policy, outputs: Any, batch: Any, idx: int) -> None:
        if self.per_push:
            self._check(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.per_push:
            self._check(pl_module)

    def _check(self, pl_module: pl.LightningModule) -> None:
        ours = model_digests(pl_module.model)
        if self.engine is not None:
            self.records.append(
                {
                    "version": self.sync.weight_version,
                    "engine_version": self.engine.get_weight_version(),
                    "mismatched": mismatches(ours, self.engine.checksum()),
                }
            )

    def summary(self, logger: MetricsInMemory, expected_pushes: int | None = None) -> dict[str, Any]:
        """Versions (as logged by VLLMWeightSync and as the receiver reports them), bit-exactness, push figures."""
        logged = [int(v) for v in logger.values("vllm/weight_version")]
        checked = [record["version"] for record in self.records]
        engine_versions = [record["engine_version"] for record in self.records]
        mismatched = sorted({name for record in self.records for name in record["mismatched"]})
        seconds = logger.values("vllm/sync_seconds")
        versions_ok = bool(checked and logged) and engine_versions == [str(v) for v in checked]
        versions_ok = versions_ok and checked[-1] == logged[-1]
        if expected_pushes is not None:  # one push per step and none at fit start: versions 1..N
            versions_ok = versions_ok and logged == list(range(1, expected_pushes + 1))
        if self.per_push:
            versions_ok = versions_ok and checked == logged
        result = {
            "versions": logged,
            "engine_versions": engine_versions,
            "versions_ok": versions_ok,
            "bit_exact_checks": len(self.records),
            "bit_exact": bool(self.records) and not mismatched,
            "mismatched": mismatched[:5],
            "differs_before_first_push": self.differs_before_first_push,
            "push_seconds": [round(s, 4) for s in seconds],
            "push_seconds_median": round(statistics.median(seconds), 4) if seconds else None,
            "push_bytes": int(logger.values("vllm/sync_bytes")[-1]) if seconds else None,
        }
        first_ok = self.differs_before_first_push or not self.check_first
        result["ok"] = bool(versions_ok and result["bit_exact"] and first_ok)
        return result


class StepTimer(Callback):
    """Wall time between the starts of consecutive training steps (the last ends at the end of training)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def _mark(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the training stream only: a background push runs on its own
        self.marks.append(time.perf_counter())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._mark()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark()

    def median(self, skip: int = 2) -> float:
        steps = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return statistics.median(steps[skip:] or steps)


def raw_broadcast(engine: ReceiverEngine, num_bytes: int, rounds: int, device: torch.device) -> list[float]:
    """Seconds of ``rounds`` bare ``PyNcclCommunicator`` broadcasts of ``num_bytes`` to the receiver (after one
    untimed), in a group of their own: the floor of a push of that many bytes between these two processes."""
    return timed_broadcasts(engine.raw_broadcast, num_bytes, rounds, device)


def gbps(num_bytes: int | None, seconds: float | None) -> float | None:
    return round(num_bytes / seconds / 1e9, 2) if num_bytes and seconds else None


# -- the runs ---------------------------------------------------------------------------


def train_and_check(
    args: argparse.Namespace,
    name: str,
    backend: str,
    receiver_gpu: int,
    gpus: list[int],
    model: str,
    steps: int,
    sharded: bool = False,
    per_push: bool = True,
    extra: Callable[[ReceiverEngine | None], Callback] | None = None,
) -> dict[str, Any] | None:
    """Trainer.fit with a VLLMWeightSync pushing to a receiver after every step, checked by PushCheck."""
    profile: Profile = args.profile
    backend = profile.backend(backend)
    engine = None
    if local_rank() == 0:  # only rank 0 holds an engine; the others gather with it
        engine = ReceiverEngine(MODELS[model](), device=profile.device(receiver_gpu), backend=backend)
    try:
        sync = VLLMWeightSync(
            engine=engine,
            every_n_train_steps=1,
            push_on_fit_start=False,
            backend=backend,
            master_address=MASTER_ADDRESS,
            timeout_seconds=args.timeout,
            changed_only=not args.send_all,
        )
        check, logger = PushCheck(sync, engine, per_push=per_push or args.check_every_push), MetricsInMemory()
        callbacks = [sync, check] + ([extra(engine)] if extra else [])
        trainer = make_trainer(profile, gpus, callbacks, steps, fsdp2(gpus) if sharded else "auto", logger)
        policy = Policy(model, fsdp=sharded)
        if engine is not None:
            engine.wait_ready()
        start = time.perf_counter()
        trainer.fit(policy, token_batches(profile, policy.config.vocab_size, steps))
        if engine is None:
            return None
        result = {"run": name, "backend": backend, "model": model, "trainer_gpus": gpus, "receiver": engine.device}
        result["receiver_import_workaround"] = engine.wait_ready()["import_workaround"]
        result |= {"steps": steps, "fit_seconds": round(time.perf_counter() - start, 2)}
        result |= check.summary(logger, expected_pushes=steps)
        result["push_gbps"] = gbps(result["push_bytes"], result["push_seconds_median"])
        return result | ({"extra": callbacks[-1].figures} if extra else {})
    finally:
        if engine is not None:
            engine.close()


def run_nccl(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run 1: Trainer on GPU 0, receiver on GPU 1, NCCL, bit-exact after every push, versions 1..N."""
    return train_and_check(args, "nccl", "nccl", 1, [0], args.profile.small, args.profile.steps)


def run_ipc(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run 2: the same over CUDA IPC, trainer and receiver on GPU 0."""
    return train_and_check(args, "ipc", "ipc", 0, [0], args.profile.small, args.profile.steps)


def run_fsdp2(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run 3: FSDP2 over GPUs 0 and 1 (ModelParallelStrategy), rank 0 sends to a receiver on GPU 1."""
    profile = args.profile
    return train_and_check(args, "fsdp2", "nccl", 1, [0, 1], profile.small, profile.steps, sharded=True)


def run_stall(args: argparse.Namespace) -> dict[str, Any]:
    """Run 4: median step time without pushes, with blocking pushes, with background pushes (blocking=False)."""
    profile: Profile = args.profile
    backend = profile.backend("nccl")
    engine = ReceiverEngine(MODELS[profile.small](), device=profile.device(1), backend=backend)
    modes: dict[str, dict[str, Any]] = {}
    try:
        for mode in ("none", "blocking", "background"):
            timer, logger = StepTimer(), MetricsInMemory()
            callbacks: list[Callback] = [timer]
            check = None
            if mode != "none":
                sync = VLLMWeightSync(
                    engine=engine,
                    every_n_train_steps=1,
                    backend=backend,
                    master_address=MASTER_ADDRESS,
                    timeout_seconds=args.timeout,
                    blocking=mode == "blocking",
                )
                # Checked once, at the end (nothing inside the timed steps); the receiver holds the last mode's weights.
                check = PushCheck(sync, engine, per_push=False, check_first=False)
                callbacks += [sync, check]
            policy = Policy(profile.small)
            engine.wait_ready()
            trainer = make_trainer(profile, [0], callbacks, args.stall_steps, logger=logger)
            trainer.fit(policy, token_batches(profile, policy.config.vocab_size, args.stall_steps))
            stalls = logger.values("vllm/sync_stall_seconds")
            modes[mode] = {"step_seconds_median": round(timer.median(), 4)}
            if check is not None:
                summary = check.summary(logger)
                modes[mode] |= {key: summary[key] for key in ("bit_exact", "versions_ok", "versions", "push_seconds")}
                modes[mode] |= {
                    "logged_stall_seconds_median": round(statistics.median(stalls), 4) if stalls else None,
                    "skipped": int(max(logger.values("vllm/sync_skipped") or [0])),
                }
    finally:
        engine.close()
    base = modes["none"]["step_seconds_median"]
    blocking = modes["blocking"]["step_seconds_median"] - base
    background = modes["background"]["step_seconds_median"] - base
    return {
        "run": "stall",
        "backend": backend,
        "model": profile.small,
        "steps": args.stall_steps,
        "modes": modes,
        "blocking_stall_seconds": round(blocking, 4),
        "background_stall_seconds": round(background, 4),
        "background_over_blocking": round(background / blocking, 3) if blocking > 0 else None,
        "ok": all(modes[m]["bit_exact"] and modes[m]["versions_ok"] for m in ("blocking", "background")),
    }


def _trainer_model(profile: Profile, config: Any, engine: ReceiverEngine) -> tuple[torch.device, torch.nn.Module]:
    """The trainer's device (made current on a GPU) and its model of ``config``, once ``engine`` is ready."""
    device = torch.device(profile.device(0))
    if profile.gpu:
        torch.cuda.set_device(device)
    model = build_model(config, device, seed=0)
    engine.wait_ready()
    return device, model


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Run 5a: updater.push_weights of the large model from one process, against a bare PyNccl broadcast."""
    profile: Profile = args.profile
    backend = profile.backend("nccl")
    config = MODELS[profile.large]()
    engine = ReceiverEngine(config, device=profile.device(1), backend=backend)
    try:
        device, model = _trainer_model(profile, config, engine)
        updater = VLLMUpdater(
            engine=engine, backend=backend, master_address=MASTER_ADDRESS, timeout_seconds=args.timeout,
            changed_only=False,  # every push sends every byte: the same weights again would send nothing
            bucket_size_bytes=args.bucket_size_bytes,
        )  # fmt: skip
        start = time.perf_counter()
        updater.init(VLLMUpdater.get_model_metadata(model))
        init_seconds = time.perf_counter() - start
        walls, syncs = [], []
        for _ in range(1 + args.rounds):  # the first push warms up (NCCL channels, allocator)
            start = time.perf_counter()
            stats = updater.push_weights(model)
            walls.append(time.perf_counter() - start)
            syncs.append(stats.seconds)
        mismatched = mismatches(model_digests(model), engine.checksum())
        engine_version = engine.get_weight_version()
        updater.close()
        raw = raw_broadcast(engine, stats.num_bytes, args.rounds, device) if profile.gpu else []
    finally:
        engine.close()
    ours, floor = statistics.median(walls[1:]), (statistics.median(raw) if raw else None)
    return {
        "run": "throughput",
        "backend": backend,
        "model": profile.large,
        "bytes": stats.num_bytes,
        "bucket_size_bytes": updater.options.bucket_size_bytes,
        "init_seconds": round(init_seconds, 3),
        "push_seconds": round(ours, 4),
        "push_gbps": gbps(stats.num_bytes, ours),
        "push_seconds_all": [round(s, 4) for s in walls],
        "sync_seconds_all": [round(s, 4) for s in syncs],
        "raw_seconds": round(floor, 4) if floor else None,
        "raw_gbps": gbps(stats.num_bytes, floor),
        "raw_seconds_all": [round(s, 4) for s in raw],
        "ours_over_raw": round(ours / floor, 3) if floor else None,
        "bit_exact": not mismatched,
        "mismatched": mismatched[:5],
        "versions_ok": engine_version == str(updater.weight_version) == str(1 + args.rounds),
        "ok": not mismatched and engine_version == str(1 + args.rounds),
    }


class GatherFloor(Callback):
    """At the end of fitting, every rank gathers every parameter (what a push of a sharded model cannot avoid),
    then rank 0 broadcasts the same bytes to the receiver over a bare PyNccl group: the floor of a sharded push."""

    def __init__(self, engine: ReceiverEngine | None, rounds: int, gpu: bool) -> None:
        self.engine, self.rounds, self.gpu = engine, rounds, gpu
        self.figures: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.model.parameters())
        seconds, num_bytes = [], 0
        for _ in range(self.rounds + 1):
            trainer.strategy.barrier()
            synchronize()
            start, num_bytes = time.perf_counter(), 0
            for param in params:
                full = param.full_tensor()
                num_bytes += full.numel() * full.element_size()
                del full
            synchronize()
            seconds.append(time.perf_counter() - start)
        if self.engine is None:
            return
        gather = statistics.median(seconds[1:])
        raw = raw_broadcast(self.engine, num_bytes, self.rounds, trainer.strategy.root_device) if self.gpu else []
        floor = gather + statistics.median(raw) if raw else None
        self.figures = {"gather_seconds": round(gather, 4), "raw_broadcast_seconds_all": [round(s, 4) for s in raw]}
        self.figures["floor_seconds"] = round(floor, 4) if floor else None


def run_fsdp2_throughput(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run 5b: FSDP2 pushes of the large model (GPUs 0 and 1, receiver on GPU 1) against gather + bare broadcast."""
    profile: Profile = args.profile
    result = train_and_check(
        args, "fsdp2-throughput", "nccl", 1, [0, 1], profile.large, 1 + args.rounds, sharded=True, per_push=False,
        extra=lambda engine: GatherFloor(engine, args.rounds, profile.gpu),
    )  # fmt: skip
    if result is None:
        return None
    pushes = result["push_seconds"]
    ours = statistics.median(pushes[1:] or pushes)  # the first push warms up
    floor = result["extra"].get("floor_seconds")
    result |= {"push_seconds_median": ours, "push_gbps": gbps(result["push_bytes"], ours)}
    result["ours_over_floor"] = round(ours / floor, 3) if floor else None
    return result


def run_kill(args: argparse.Namespace) -> dict[str, Any]:
    """Run 6: the receiver is SIGKILLed while it is inside update_weights; does the push fail in time?"""
    profile: Profile = args.profile
    backend = profile.backend("nccl")
    config = MODELS[profile.small]()
    engine = ReceiverEngine(config, device=profile.device(1), backend=backend, stall_update_seconds=600)
    device, model = _trainer_model(profile, config, engine)
    updater = VLLMUpdater(
        engine=engine, backend=backend, master_address=MASTER_ADDRESS, timeout_seconds=args.kill_timeout
    )
    updater.init(VLLMUpdater.get_model_metadata(model))
    outcome: dict[str, Any] = {}

    def push() -> None:
        try:
            updater.push_weights(model)
            outcome["error"] = None
        except BaseException as error:  # noqa: BLE001  # reported, whatever it is
            outcome["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        outcome["ended"] = time.perf_counter()

    pushing = threading.Thread(target=push, daemon=True)
    pushing.start()
    started = engine.update_started.wait(60)
    time.sleep(1.0)  # the trainer is now inside its broadcast, the receiver asleep inside update_weights
    killed = time.perf_counter()
    engine.kill()
    pushing.join(2 * args.kill_timeout + 15)  # each bounded wait of the push is at most kill_timeout
    usable = threading.Event()
    threading.Thread(target=lambda: (torch.ones(1, device=device).add(1).item(), usable.set()), daemon=True).start()
    usable.wait(10)
    hung = pushing.is_alive()
    return {
        "run": "kill",
        "backend": backend,
        "update_started": started,
        "push_error": outcome.get("error"),
        "hung": hung,
        "seconds_after_kill": None if hung else round(outcome["ended"] - killed, 2),
        "timeout_seconds": args.kill_timeout,
        "engine_is_dead": engine.is_dead(),
        "trainer_device_usable": usable.is_set(),
        "ok": not hung and outcome.get("error") is not None,
    }


RUNS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any] | None], float]] = {
    "nccl": (run_nccl, 120),
    "ipc": (run_ipc, 100),
    "fsdp2": (run_fsdp2, 150),
    "stall": (run_stall, 150),
    "throughput": (run_throughput, 150),
    "fsdp2-throughput": (run_fsdp2_throughput, 200),
    "kill": (run_kill, 150),
}
"""Each run and its wall-clock limit under ``--all``, in the order ``--all`` runs them (most important first)."""


# -- running ------------------------------------------------------------------------------


def run_one(name: str, argv: list[str], limit: float, log_dir: Path) -> dict[str, Any]:
    """Run ``name`` in a session of its own (receivers and re-launched ranks included), killed after ``limit`` s."""
    log_path = log_dir / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), name, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            process.wait(limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever the run left: receivers, ranks, stuck threads
            except ProcessLookupError:
                pass
            process.wait(30)
    lines = log_path.read_text(errors="replace").splitlines()
    results = [json.loads(line) for line in lines if line.startswith('{"run"')]
    result = results[-1] if results else {"run": name, "ok": False}
    if timed_out or not results:
        result["error"] = f"timed out after {limit:g} s" if timed_out else f"exit code {process.returncode}"
        result["log_tail"] = [line[:300] for line in lines[-15:]]
    result["wall_seconds"] = round(time.monotonic() - start, 1)
    return result


def log_dir() -> Path:
    out = os.environ.get("OUT")
    path = (Path(out) if out else Path("/tmp")) / "gpu_logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_all(args: argparse.Namespace, passed: list[str]) -> int:
    deadline = time.monotonic() + args.budget
    results = []
    for name, (_, limit) in RUNS.items():
        left = deadline - time.monotonic()
        if left < 30:
            results.append({"run": name, "ok": False, "error": f"skipped: the {args.budget:g} s budget is spent"})
        else:
            results.append(run_one(name, passed, min(limit, left), log_dir()))
        print(json.dumps(results[-1]), flush=True)
        if os.environ.get("OUT"):  # after every run, so a cut-short --all keeps what it measured
            (Path(os.environ["OUT"]) / "gpu_results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({"all_ok": all(r.get("ok") for r in results), "logs": str(log_dir())}), flush=True)
    return 0 if all(r.get("ok") for r in results) else 1


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", choices=list(RUNS), help="one run (or --all)")
    parser.add_argument("--all", action="store_true", help="every run, each in a process of its own")
    parser.add_argument("--budget", type=float, default=480, help="--all: seconds for all runs together")
    parser.add_argument("--limit", type=float, help="one run: its wall-clock limit (default: its own, see RUNS)")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU: tiny models, gloo, no NCCL floor")
    parser.add_argument("--timeout", type=float, default=60, help="timeout_seconds of the updater")
    parser.add_argument("--kill-timeout", type=float, default=15, help="timeout_seconds of the updater in run kill")
    parser.add_argument("--rounds", type=int, default=3, help="timed pushes of the throughput runs")
    parser.add_argument(
        "--bucket-size-bytes", type=int, default=1 << 30, help="bucket_size_bytes of the throughput run (vLLM's buffer)"
    )
    parser.add_argument("--send-all", action="store_true", help="training runs: changed_only=False")
    parser.add_argument("--check-every-push", action="store_true", help="fsdp2-throughput: check after each push")
    parser.add_argument("--stall-steps", type=int, default=12, help="training steps per mode of the stall run")
    parser.add_argument("--in-session", action="store_true", help=argparse.SUPPRESS)  # set by run_one
    args = parser.parse_args(argv)
    if not args.all and args.run is None:
        parser.error("name a run or pass --all")
    args.profile = CPU if args.cpu else GPU
    passed = ["--in-session", "--timeout", str(args.timeout), "--kill-timeout", str(args.kill_timeout)]
    passed += ["--rounds", str(args.rounds), "--stall-steps", str(args.stall_steps)]
    passed += ["--bucket-size-bytes", str(args.bucket_size_bytes)]
    passed += (["--send-all"] if args.send_all else []) + (["--check-every-push"] if args.check_every_push else [])
    return args, passed + (["--cpu"] if args.cpu else [])  # what run_one gives the run


def main() -> None:
    args, passed = parse_args(sys.argv[1:])
    if args.all:
        sys.exit(run_all(args, passed))
    if not args.in_session:  # bounded, and everything it starts is killed after it: run it in a session of its own
        result = run_one(args.run, passed, args.limit or RUNS[args.run][1], log_dir())
        print(json.dumps(result), flush=True)
        sys.exit(0 if result.get("ok") else 1)
    result = RUNS[args.run][0](args)
    if result is not None:
        print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # Not a normal exit: after a failed transfer a thread may be blocked in NCCL for good (vLLM's update
    # thread is joined at interpreter exit), and this process must still end.
    os._exit(0 if result is None or result.get("ok") else 1)


if __name__ == "__main__":
    main()
