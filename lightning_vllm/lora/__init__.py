"""LoRA policies, in one package: what is sent and how an engine serves it (a policy sent as merged
full weights, never merging the live model, is ``weights/lora_merge.py``).

- ``adapter.py``: the adapter sent alone (``AdapterWeights``, the first push's ``WithAdapter``);
- ``serving.py``: an engine's LoRA settings (``LoraLimits``), whether it can serve a policy's
  adapter (``adapter_problems``), the choice between adapter and merged weights that follows
  (``choose_view_of_problems``), and the adapter it generates through (``PolicyAdapter``);
- ``worker.py``: inside a vLLM worker, a received adapter checked and staged for vLLM's loader;
- ``cpu_ops.py``: grouped LoRA ops for vLLM's CPU build (``LIGHTNING_VLLM_CPU_LORA_OPS=grouped``).

See ``docs/lora.md``.
"""
