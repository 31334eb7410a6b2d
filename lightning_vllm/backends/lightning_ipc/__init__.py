"""``lightning_ipc``: vLLM's CUDA-IPC protocol with handles kept open. ``backend.py`` is what the core asks of it,
``trainer.py`` its trainer side (each tensor's handle sent once while the trainer's storage stays put), ``worker.py``
its worker side (inside vLLM's workers: one batched copy a push, the handles kept open), ``recorded_loads.py`` the loads
the worker records and replays."""
