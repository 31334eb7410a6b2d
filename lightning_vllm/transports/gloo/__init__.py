"""The ``gloo`` backend: vLLM's weight-transfer protocol for CPUs, over one TCP connection per worker.

vLLM ships NCCL and CUDA-IPC engines only. This package adds both halves of a CPU
backend, registered under the name ``gloo`` by ``transports/plugin.py``. The name is
that of the wire it was first built on; the bytes now move over plain sockets to the one
port the trainer listens on (``group.py`` says why). One module per question:

* ``messages.py``: what crosses the process boundary (init and update infos, dtype names).
* ``group.py``: the wire: the trainer's listening socket, the workers' connections, the broadcasts.
* ``trainer.py``: :class:`GlooTrainerWeightTransferEngine`, which plans a sync and sends it.
* ``receiver.py``: a worker's connection to the trainer and its kept receive buffers.
* ``worker.py``: :class:`GlooWeightTransferEngine`, what vLLM builds in every worker.
* ``tied_embedding_fix.py``: the vLLM 0.32 CPU bug worked around after each load.

A sync is one ``start_weight_update``, one ``update_weights`` (carrying the whole
bucket plan) and one ``finish_weight_update`` call, whatever the number of tensors.
No pickled data crosses the wire: control messages are plain dataclasses, tensors
are raw bytes.
"""

from lightning_vllm.transports.gloo.messages import (
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from lightning_vllm.transports.gloo.trainer import GlooTrainerWeightTransferEngine, send_order
from lightning_vllm.transports.gloo.worker import GlooWeightTransferEngine

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
    "send_order",
]
