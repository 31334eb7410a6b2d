"""LoRA policies, in one package: what is sent and how an engine serves it.

- ``merge.py``: a PEFT LoRA policy sent as merged full weights (never merging the live model);
- ``adapter.py``: the adapter sent alone (``AdapterWeights``, the first push's ``WithAdapter``),
  whether an engine can serve it, and the choice between the two (``choose_view``);
- ``serving.py``: an engine's LoRA settings (``LoraLimits``) and the adapter it generates
  through (``PolicyAdapter``);
- ``worker.py``: inside a vLLM worker, a received adapter checked and staged for vLLM's loader;
- ``cpu_ops.py``: grouped LoRA ops for vLLM's CPU build (``LIGHTNING_VLLM_CPU_LORA_OPS=grouped``).

See ``docs/lora.md``.
"""
