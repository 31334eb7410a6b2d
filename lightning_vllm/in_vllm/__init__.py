"""What vLLM's own processes load of this package, beside the backends' worker sides (``backends/*/worker.py``):

- ``plugin.py``: vLLM's plugin entry point; it only registers (the backends by module name, so that each process
  imports the side it builds) and applies what the environment asks for;
- ``worker_methods.py``: the methods the plugin gives every vLLM worker, called by name for the check after every
  push;
- ``busy_wait.py``: the cap on vLLM's busy-wait that the plugin applies;
- ``lora_adapters.py``: a LoRA adapter received by a worker, checked and staged where vLLM loads it;
- ``lora_ops.py``: grouped LoRA ops for vLLM's CPU build.

Nothing here, nor in a backend's worker side, imports Lightning or the trainer's side
(``tests/test_architecture.py`` checks it in a fresh process).
"""
