"""The one-GPU NCCL harness: every NCCL party of a test is an NCCL host of its own on the one GPU.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") only when their host hashes
match, and ``NCCL_HOSTID`` sets a process's host hash. So each party gets a value of its own: the trainer process
(and each trainer rank of a multi-node run), the engine core of each in-process ``vllm.LLM`` or ``AsyncLLM``, each
``vllm serve``. The duplicate check then passes, and the ranks talk over NCCL's socket transport on loopback
(``NCCL_SOCKET_IFNAME=lo``).

This lives in the tests only. A user's engine on the trainer's own GPU, both in one host's hash, is still refused
by the product (``backends/nccl/backend.py``; ``tests/gpu/test_gpu_refusals.py``). What it proves: vLLM's NCCL
engine, our ``nccl`` backend, vLLM's model runner and generation, every failure path, over real NCCL. What it does
not: speed (the bytes go through host sockets, not NVLink or PCIe P2P) nor NCCL's GPU-to-GPU transports (docs/gpu.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

TRAINER = "lightning-vllm-trainer"
"""The host id of the test process (the trainer of the in-process engines' tests)."""

NCCL_SETTINGS = {"NCCL_SOCKET_IFNAME": "lo"}


def host_env(host: str) -> dict[str, str]:
    """The environment that makes a process the NCCL host ``host`` (for a subprocess's ``env``)."""
    return {"NCCL_HOSTID": f"lightning-vllm-{host}", **NCCL_SETTINGS}


MEASURED = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
"""What the tier needs to measure an engine: the digests, memory and descriptor counts run functions in vLLM's workers
(``collective_rpc``), which vLLM sends pickled only with it. The trainer's process has it from the start, and an
engine core takes it when it starts. Never an engine core with it and the trainer without: vLLM's engine core then
tags a utility call's result with its type, which the trainer's client refuses to decode, and the call waits for
good (seen on the H200: ``get_weight_version`` hung). Pushes over ``nccl`` need none of it: the ``AsyncLLM`` of the
tier starts without it."""


def become_trainer_host() -> None:
    """Make this process the trainer's NCCL host (before its first NCCL communicator: NCCL reads the variable when a
    communicator is made), with :data:`MEASURED`."""
    os.environ.update(NCCL_HOSTID=TRAINER, **NCCL_SETTINGS, **MEASURED)


@contextmanager
def starting_as(host: str, measured: bool = True) -> Iterator[None]:
    """Inside, what this process starts (a ``vllm.LLM``'s or ``AsyncLLM``'s engine core, which takes the
    environment of the moment) is the NCCL host ``host``, without :data:`MEASURED` unless ``measured``; this
    process is the trainer's again afterwards."""
    with pytest.MonkeyPatch.context() as scoped:
        for name, value in host_env(host).items():
            scoped.setenv(name, value)
        for name in () if measured else MEASURED:
            scoped.delenv(name, raising=False)
        yield
