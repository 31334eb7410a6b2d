"""How bytes move: one object per weight-transfer backend, registered by name as vLLM's factory does.

- ``base.py``: :class:`Backend` (its name, its :class:`Traits`, what it checks before a byte moves,
  its init info, the group it joins) and :class:`Sender` (a joined group's send);
- ``registry.py``: the names and the modules that hold them (one line a backend), and the choice
  of a backend for an engine;
- ``gloo.py``: ours, for CPUs (``transports/gloo/`` is its wire);
- ``vllm_engines.py``: the one adapter over vLLM's trainer engines (NCCL, IPC), where vLLM's API
  churn lands;
- ``nccl.py``, ``ipc.py``: vLLM's two GPU backends, through that adapter.

Adding a backend is one module with a :class:`Backend` subclass, plus one line in ``registry.py``
(or a ``register_backend`` call); nothing outside this package compares backend names.
"""

from lightning_vllm.backends.base import Backend, GroupPlan, Outgoing, Sender, Traits
from lightning_vllm.backends.registry import backend_for_engine, backend_named, check_requested, register_backend

__all__ = [
    "Backend",
    "GroupPlan",
    "Outgoing",
    "Sender",
    "Traits",
    "backend_for_engine",
    "backend_named",
    "check_requested",
    "register_backend",
]
