"""The parent's side of a trainer killed in a push into ``vllm serve`` over nccl (``killed_trainer_run.py`` is the
trainer's): start it as an NCCL host of its own, SIGKILL it once it stopped itself, then see whether the server serves
again and takes the next trainer's push. Every wait is bounded. Used by ``test_nccl_nodes.py`` (vLLM's ``nccl``) and
``test_lightning_nccl_server.py`` (``lightning_nccl``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import killed_trainer_run
import psutil
from helpers import engine_prompt_logprobs, wait_for_health
from nccl_hosts import host_env

from lightning_vllm import HTTPEngine, VLLMUpdater
from lightning_vllm._waits import call_with_timeout

STOP_SECONDS = 180.0
"""The longest the killed trainer may take to start, land its first push and stop itself in its second."""
ANSWER_MARGIN_SECONDS = 10.0
"""How long past the killed trainer's ``timeout_seconds`` the server may take to serve again."""


def logs_dir(tmp_path: Path) -> Path:
    """Where the subprocesses' logs go: ``$OUT`` on the GPU host, so that they come back from it."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else tmp_path


def kill_when_stopped(url: str, record: Path, log: Path, point: str) -> None:
    """Run ``killed_trainer_run.py`` against ``url`` (its landed version goes to ``record``, its output to ``log``),
    an NCCL host of its own, until it stops itself at ``point`` of its second push (at most :data:`STOP_SECONDS`);
    then SIGKILL it. Fails, with the end of its log, if it exited or ran on instead."""
    with open(log, "w") as output:
        env = {**os.environ, **host_env(f"killed-trainer-{point}")}
        command = [sys.executable, str(killed_trainer_run.__file__), url, str(record), point]
        trainer = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        state = wait_until_stopped(trainer, STOP_SECONDS)
        assert state == "stopped", f"the trainer {state} instead of stopping at {point}:\n" + log.read_text()[-4000:]
    finally:
        trainer.kill()
        trainer.wait(timeout=30)


def wait_until_stopped(process: subprocess.Popen, timeout: float) -> str:
    """Poll until ``process`` has stopped itself (SIGSTOP) or exited, at most ``timeout`` seconds; what it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited with {process.returncode}"
        if psutil.Process(process.pid).status() == psutil.STATUS_STOPPED:
            return "stopped"
        time.sleep(0.2)
    return f"still running after {timeout:g} s"


def serves_again(url: str, since: float, within: float) -> dict[str, Any]:
    """How many seconds after ``since`` the server answered a health probe and then a completion, asking again
    until ``within`` seconds after ``since``; the last error if it never did."""
    engine = HTTPEngine(url, timeout_seconds=5.0, generate_timeout_seconds=within)
    deadline = since + within
    try:
        wait_for_health(url, timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, RuntimeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            what = "a completion from the server after the kill"
            call_with_timeout(engine_prompt_logprobs, engine, timeout=max(0.1, deadline - time.monotonic()), what=what)
            return {"seconds": round(time.monotonic() - since, 2)}
        except Exception as error:  # noqa: BLE001  # paused (503) or blocked: asked again until the deadline
            last_error = f"{type(error).__name__}: {error}"[:400]
            time.sleep(0.5)
    return {"error": f"no completion within {within:g} s of the kill; the last answer: {last_error}"}


def next_trainer_pushes(url: str, model: Any) -> dict[str, Any]:
    """A new updater in this process pushes ``model`` into the same server (no restart): its version, or its error
    and then the outcome of one more push (the record says whether a second was needed, and why)."""
    updater = VLLMUpdater(engine=HTTPEngine(url), timeout_seconds=30)
    outcome: dict[str, Any] = {}
    try:
        for attempt in ("first", "second"):
            started = time.monotonic()
            try:
                landed = updater.push_weights(model).weight_version
            except Exception as error:  # noqa: BLE001  # recorded, and asserted on by the test
                outcome[attempt] = {"error": f"{type(error).__name__}: {error}"[:400]}
            else:
                outcome[attempt] = {"landed": landed}
            outcome[attempt]["seconds"] = round(time.monotonic() - started, 2)
            if "landed" in outcome[attempt]:
                break
    finally:
        updater.close()
    return outcome
