"""Whether an engine will carry vLLM's CUDA IPC handles (the ``ipc`` backend), asked before any byte moves.

vLLM's IPC engine hands the workers, in each ``update_weights``, the arguments of
``torch.multiprocessing.reductions.rebuild_cuda_tensor``: besides ints and bytes they hold
``torch.Tensor``, ``torch.UntypedStorage`` (classes) and a ``torch.dtype``. Those are not
msgpack types, so:

- an in-process ``vllm.LLM`` or ``AsyncLLM`` whose engine core runs in a process of its own
  (vLLM's default) sends them over its msgspec RPC, which encodes them with pickle only when
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, in the trainer's process (it encodes) *and* in the
  engine core's (it decodes; the variable is read there when the process starts). Without it
  the encoder raises ``TypeError ... is not serializable`` after ``start_weight_update``;
  a decoder without it would stop the engine core's input thread;
- a server (``vllm serve``) gets them pickled in ``ipc_handles_pickled`` (what vLLM's own
  ``HTTPVLLMWeightSyncClient`` sends), which its workers unpickle only with the same variable
  set in the server's environment;
- an engine core in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) serializes
  nothing, but its worker then opens the CUDA IPC handles in the process that made them, which
  CUDA refuses: measured on an H200 with vLLM 0.33, the first push failed in the worker's
  ``rebuild_cuda_tensor`` with ``CUDA error: invalid device context``. So ``ipc`` is refused there
  too, before a byte moves.

What the variable allows: wherever vLLM's RPC decodes a message, a pickled object in it is
unpickled, that is, any process that can write to the engine core's sockets (local ZMQ IPC
sockets of the trainer's user) or, for a server, post to ``/update_weights`` can run code
there. docs/security.md says how to keep those closed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"

WHY = (
    "vLLM's ipc backend passes CUDA IPC handles (tensor and storage classes, a dtype) to the workers, which vLLM's "
    "RPC carries only as pickle, and it allows pickle only with VLLM_ALLOW_INSECURE_SERIALIZATION=1"
)


def flag_set(value: Any) -> bool:
    """vLLM's reading of the variable: an integer, ``1`` (or any non-zero) meaning set.

    Example::

        >>> flag_set("1"), flag_set("0"), flag_set(None), flag_set(True)
        (True, False, False, True)
    """
    if isinstance(value, bool):
        return value
    try:
        return bool(int(str(value))) if value is not None else False
    except ValueError:
        return False


def process_environment(pid: int) -> dict[str, str] | None:
    """The environment a process started with (Linux ``/proc``), ``None`` where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def engine_core_processes(engine_core: Any) -> list[Any]:
    """The engine-core processes a vLLM engine-core client started (empty for an in-process core)."""
    manager = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def ipc_handles_problem(engine_core: Any, description: str) -> str | None:
    """Why an in-process ``vllm.LLM``/``AsyncLLM`` with this engine-core client would refuse CUDA IPC
    handles (``None``: it takes them), with the fix.

    An engine core in this process cannot take them at all. Otherwise the trainer's process must
    have the variable now (vLLM reads it at each encode). A spawned engine core read it when it
    started, which ``/proc`` shows; a forked one copied this process's environment when it was
    forked, which is taken to be the current one.
    """
    if getattr(engine_core, "_send_input", None) is None:
        return (
            f"The {description} engine runs its engine core in the trainer's process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0), where vLLM's ipc backend cannot work: its worker would open the "
            "CUDA IPC handles in the process that made them, which CUDA refuses ('invalid device context'). Build "
            "the engine with its engine core in a process of its own (leave VLLM_ENABLE_V1_MULTIPROCESSING unset) "
            f"and {INSECURE_SERIALIZATION}=1 set before it starts (docs/security.md says what that allows)."
        )
    fix = (
        f"Set {INSECURE_SERIALIZATION}=1 in the environment before the engine is built (vLLM's engine core reads it "
        "when it starts), e.g. os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1' at the top of the training "
        "script. docs/security.md says what the variable allows."
    )
    if not flag_set(os.environ.get(INSECURE_SERIALIZATION)):
        return f"The {description} engine cannot take ipc pushes: {WHY}, which this process lacks. {fix}"
    if (pid := started_without_pickle(engine_core)) is not None:
        return (
            f"The {description} engine cannot take ipc pushes: {WHY}, and its engine core (pid {pid}) "
            f"started without it (it was set in this process after the engine was built). {fix}"
        )
    return None


def started_without_pickle(engine_core: Any) -> int | None:
    """The pid of a spawned engine core of this client that started without the variable, so that its input thread
    would stop at the first pickled message it decodes (``None``: none did, or none can be read)."""
    for process in engine_core_processes(engine_core):
        if getattr(process, "_start_method", None) != "spawn" or process.pid is None:
            continue
        environment = process_environment(process.pid)
        if environment is not None and not flag_set(environment.get(INSECURE_SERIALIZATION)):
            return int(process.pid)
    return None


def server_ipc_handles_problem(vllm_env: dict[str, Any] | None, description: str) -> str | None:
    """Why a vLLM server whose ``/server_info`` reported ``vllm_env`` would refuse pickled CUDA IPC
    handles (``None``: it takes them, or it did not say)."""
    if vllm_env is None or flag_set(vllm_env.get(INSECURE_SERIALIZATION)):
        return None
    return (
        f"The {description} cannot take ipc pushes: {WHY}; over HTTP the handles go pickled, and the server "
        f"unpickles them only when it was started with {INSECURE_SERIALIZATION}=1. Restart it with "
        f"{INSECURE_SERIALIZATION}=1 VLLM_SERVER_DEV_MODE=1 vllm serve ... (and keep /update_weights closed to "
        "anyone but the trainer: docs/security.md)."
    )
