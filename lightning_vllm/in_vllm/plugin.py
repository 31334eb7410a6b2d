"""vLLM plugin entry point: :func:`register_backends`, which says what it registers and applies.

Declared in ``pyproject.toml`` under the ``vllm.general_plugins`` entry-point
group, so vLLM calls :func:`register_backends` in each of its processes (front
end, engine core, every worker) before it builds a weight-transfer engine. An
engine created with ``weight_transfer_config={"backend": "gloo"}`` therefore works
in-process, with multiprocess workers and behind ``vllm serve``, with no user code.
It registers the backends by module name, as vLLM's factories take them, so that a process imports only the side it
builds (a worker, the worker's side) and none of the trainer's.
"""

from __future__ import annotations

import importlib

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lightning_vllm.in_vllm.busy_wait import limit_busy_wait
from lightning_vllm.in_vllm.lora_ops import install_grouped_cpu_lora_ops
from lightning_vllm.in_vllm.worker_methods import install_worker_methods

GLOO = "gloo"
_GLOO_WORKER = "lightning_vllm.backends.gloo.worker"
_GLOO_TRAINER = "lightning_vllm.backends.gloo.trainer"
LIGHTNING_IPC = "lightning_ipc"
"""vLLM's CUDA-IPC protocol with handles kept open (``backends/lightning_ipc/``)."""
_LIGHTNING_IPC_WORKER = "lightning_vllm.backends.lightning_ipc.worker"
_LIGHTNING_IPC_TRAINER = "lightning_vllm.backends.lightning_ipc.trainer"
NCCL = "nccl"
_NCCL_WORKER = "lightning_vllm.backends.nccl.worker"
LIGHTNING_NCCL = "lightning_nccl"
"""vLLM's NCCL protocol into workers that stage a push and commit it whole (``backends/lightning_nccl/``)."""
_LIGHTNING_NCCL_WORKER = "lightning_vllm.backends.lightning_nccl.worker"
_VLLM_NCCL_TRAINER = "vllm.distributed.weight_transfer.nccl_engine"


def _watched_nccl_engine() -> type:
    engine: type = importlib.import_module(_NCCL_WORKER).WatchedNCCLWeightTransferEngine
    return engine


def register_backends() -> None:
    """Register the ``gloo``, ``lightning_ipc`` and ``lightning_nccl`` worker and trainer engines with vLLM's
    factories (``lightning_nccl``'s trainer engine is vLLM's NCCL one), put the watched NCCL worker engine in place of
    vLLM's under ``nccl``; give vLLM's workers the check's methods (``worker_methods.py``); apply the busy-wait cap
    and the CPU LoRA ops that the environment asks for.

    Safe to call more than once: vLLM may load plugins repeatedly in one process.
    """
    for factory, name, module, class_name in (
        (WeightTransferEngineFactory, GLOO, _GLOO_WORKER, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, GLOO, _GLOO_TRAINER, "GlooTrainerWeightTransferEngine"),
        (WeightTransferEngineFactory, LIGHTNING_IPC, _LIGHTNING_IPC_WORKER, "InPlaceIPCWeightTransferEngine"),
        (WeightTransferTrainerFactory, LIGHTNING_IPC, _LIGHTNING_IPC_TRAINER, "KeptHandlesIPCTrainerEngine"),
        (WeightTransferEngineFactory, LIGHTNING_NCCL, _LIGHTNING_NCCL_WORKER, "StagedNCCLWeightTransferEngine"),
        (WeightTransferTrainerFactory, LIGHTNING_NCCL, _VLLM_NCCL_TRAINER, "NCCLTrainerWeightTransferEngine"),
    ):
        if name not in factory._registry:
            factory.register_engine(name, module, class_name)
    # vLLM's factory refuses a second engine under a name; its registry maps names to loaders, as register_engine does.
    WeightTransferEngineFactory._registry[NCCL] = _watched_nccl_engine
    install_worker_methods()
    limit_busy_wait()
    install_grouped_cpu_lora_ops()
