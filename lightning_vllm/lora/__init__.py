"""LoRA policies, the trainer's side: what is sent and how an engine serves it (a policy sent as merged
full weights, never merging the live model, is ``weights/lora_merge.py``).

- ``adapter.py``: the adapter sent alone (``AdapterWeights``, the first push's ``WithAdapter``);
- ``serving.py``: an engine's LoRA settings (``LoraLimits``), whether it can serve a policy's
  adapter (``adapter_problems``), the choice between adapter and merged weights that follows
  (``choose_view_of_problems``), and the adapter it generates through (``PolicyAdapter``);

What runs inside vLLM's workers is in ``in_vllm/``: a received adapter checked and staged for vLLM's loader
(``lora_adapters.py``) and grouped LoRA ops for vLLM's CPU build (``lora_ops.py``).

See ``docs/lora.md``.
"""
