"""The ``gloo`` backend: vLLM's weight-transfer protocol for CPUs, over one TCP connection per worker.

vLLM ships NCCL and CUDA-IPC engines only. This package adds both halves of a CPU
backend, registered under the name ``gloo`` by ``in_vllm/plugin.py``. The name is
that of the wire it was first built on; the bytes now move over plain sockets to the one
port the trainer listens on (``group.py`` says why). One module per question:

* ``backend.py``: :class:`GlooBackend`, what the core asks of the backend.
* ``messages.py``: what both ends agree on: the bucket layout (tensors packed into buckets, split into segments)
  and what crosses the process boundary (init and update infos, dtype names).
* ``group.py``: the wire: the connections, the broadcasts, the trainer's in-flight window and staging ring.
* ``rendezvous.py``: how the wire forms: the trainer's listening socket, the workers connecting to it.
* ``trainer.py``: :class:`GlooTrainerWeightTransferEngine`, which lays a sync out and sends it (it is the sender).
* ``shares.py``: a push every trainer rank sends a share of.
* ``receiver.py``: a worker's connection to the trainer and its kept receive buffers.
* ``worker.py``: :class:`GlooWeightTransferEngine`, what vLLM builds in every worker.
* ``tied_embedding_fix.py``, ``moe_prepack_fix.py``: vLLM CPU bugs worked around after each load.

The worker's side (``worker.py``, ``receiver.py``, ``group.py``, ``rendezvous.py``, ``messages.py`` and the fixes) is
what vLLM's workers import; nothing is imported with this package, so they load none of the trainer's side.

A sync is one ``start_weight_update``, one ``update_weights`` (carrying the whole
bucket layout) and one ``finish_weight_update`` call, whatever the number of tensors.
No pickled data crosses the wire: control messages are plain dataclasses, tensors
are raw bytes.
"""
