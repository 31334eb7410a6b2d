"""``ipc``: vLLM's CUDA-IPC engine, for an engine on the trainer's own GPU. Both ends are vLLM's; ``backend.py`` is what
the core asks of it, through vLLM's trainer engine (``backends/vllm_engines.py``)."""
