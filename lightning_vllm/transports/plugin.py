"""vLLM plugin entry point: makes the ``gloo`` and ``lightning_ipc`` backends known to vLLM and watches vLLM's ``nccl``
worker engine while it receives (``nccl_worker.py``: a failed trainer no longer leaves it waiting for good); caps
vLLM's busy-wait when ``LIGHTNING_VLLM_BUSY_LOOP_SECONDS`` asks (``busy_wait.py``); applies LoRA adapters on CPUs one
matrix product per adapter when ``LIGHTNING_VLLM_CPU_LORA_OPS=grouped`` asks (``lora/cpu_ops.py``).

Declared in ``pyproject.toml`` under the ``vllm.general_plugins`` entry-point
group, so vLLM calls :func:`register_backends` in each of its processes (front
end, engine core, every worker) before it builds a weight-transfer engine. An
engine created with ``weight_transfer_config={"backend": "gloo"}`` therefore works
in-process, with multiprocess workers and behind ``vllm serve``, with no user code.
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lightning_vllm.lora.cpu_ops import install_grouped_cpu_lora_ops
from lightning_vllm.transports.busy_wait import limit_busy_wait

GLOO = "gloo"
_WORKER_MODULE = "lightning_vllm.transports.gloo.worker"
_TRAINER_MODULE = "lightning_vllm.transports.gloo.trainer"
LIGHTNING_IPC = "lightning_ipc"
"""vLLM's CUDA-IPC protocol with handles kept open (``transports/ipc_trainer.py``), loaded by the worker with one
batched copy (``transports/ipc_worker.py``)."""
NCCL = "nccl"


def _watched_nccl_engine() -> type:
    from lightning_vllm.transports.nccl_worker import WatchedNCCLWeightTransferEngine

    return WatchedNCCLWeightTransferEngine


def register_backends() -> None:
    """Register the ``gloo`` and ``lightning_ipc`` worker and trainer engines with vLLM's factories, put the watched
    NCCL worker engine in place of vLLM's under ``nccl``; apply the busy-wait cap and the CPU LoRA ops that the
    environment asks for.

    Safe to call more than once: vLLM may load plugins repeatedly in one process.
    """
    if GLOO not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO, _WORKER_MODULE, "GlooWeightTransferEngine")
    if GLOO not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO, _TRAINER_MODULE, "GlooTrainerWeightTransferEngine")
    if LIGHTNING_IPC not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            LIGHTNING_IPC, "lightning_vllm.transports.ipc_worker", "InPlaceIPCWeightTransferEngine"
        )
    if LIGHTNING_IPC not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            LIGHTNING_IPC, "lightning_vllm.transports.ipc_trainer", "KeptHandlesIPCTrainerEngine"
        )
    # vLLM's factory refuses a second engine under a name; its registry maps names to loaders, as register_engine does.
    WeightTransferEngineFactory._registry[NCCL] = _watched_nccl_engine
    limit_busy_wait()
    install_grouped_cpu_lora_ops()
