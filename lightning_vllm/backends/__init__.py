"""How bytes move, on both ends: one folder per weight-transfer backend, registered by name as vLLM's factory does.

- ``base.py``: :class:`Backend` (its name, its :class:`Traits`, what it checks before a byte moves,
  its init info, the group it joins) and :class:`Sender` (a joined group's send);
- ``registry.py``: the names and the modules that hold them (one line a backend), and the choice
  of a backend for an engine;
- ``vllm_engines.py``: the one adapter over vLLM's trainer engines (``nccl``, ``ipc``, ``lightning_ipc``,
  ``lightning_nccl``), where vLLM's API churn lands;
- one folder a backend: ``gloo/`` (ours, for CPUs), ``nccl/`` and ``ipc/`` (vLLM's), ``lightning_ipc/`` (vLLM's
  CUDA-IPC protocol with handles kept open), ``lightning_nccl/`` (vLLM's NCCL protocol into workers that stage a
  push and commit it whole). Each holds its :class:`Backend` (``backend.py``), its trainer side
  and its worker side (``worker.py``: what runs inside vLLM's workers, loaded there through ``in_vllm/plugin.py``).

Adding a backend is one folder with a :class:`Backend` subclass, plus one line in ``registry.py``
(or a ``register_backend`` call); nothing outside this package compares backend names.

Nothing is imported with this package: vLLM's workers import a backend's worker side, below it, and need nothing
of the trainer's. Import from ``base.py`` and ``registry.py``.
"""
