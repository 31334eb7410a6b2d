"""``nccl``: vLLM's NCCL engine, for an engine on GPUs of its own. ``backend.py`` is the trainer's side, through vLLM's
trainer engine (``backends/vllm_engines.py``); ``worker.py`` runs inside vLLM's workers, where the plugin puts it under
vLLM's name: vLLM's worker engine, watched while it receives, so that a trainer failing mid-push aborts the group."""
