"""How bytes move under our ``gloo`` backend (``backends/gloo.py``): its wire (``gloo/``), the bucket
layout (``buckets.py``), the trainer's staging ring (``staging.py``), and the plugin vLLM loads in
each of its processes (``plugin.py``, with ``busy_wait.py``); and the two ends of ``lightning_ipc``, vLLM's
CUDA-IPC protocol with handles kept open (``ipc_trainer.py``, ``ipc_worker.py``, ``load_plan.py``). The
backends themselves, ours and vLLM's, are objects in ``lightning_vllm.backends``.
"""
