"""The backends by name, as vLLM's ``WeightTransferEngineFactory`` keeps its engines: a name, the
module that holds the class, and the class's name; the module is imported when first asked for.

A new backend is a module with a :class:`~lightning_vllm.backends.base.Backend` subclass and one
line below (or one :func:`register_backend` call, as a test does).
"""

from __future__ import annotations

import importlib

from lightning_vllm.backends.base import Backend
from lightning_vllm.errors import EngineConfigError

AUTO = "auto"
"""Not a backend: the one each engine was built with (its ``weight_transfer_config``)."""

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_backend(name: str, module: str, class_name: str) -> None:
    """Make the backend ``name`` the class ``class_name`` of ``module`` (imported when first used).

    Raises:
        ValueError: ``name`` is taken by another class, or is ``"auto"``.
    """
    if name == AUTO or _REGISTRY.get(name, (module, class_name)) != (module, class_name):
        raise ValueError(f"The backend name {name!r} is taken; pick another.")
    _REGISTRY[name] = (module, class_name)


register_backend("gloo", "lightning_vllm.backends.gloo.backend", "GlooBackend")
register_backend("nccl", "lightning_vllm.backends.nccl.backend", "NCCLBackend")
register_backend("ipc", "lightning_vllm.backends.ipc.backend", "IPCBackend")
register_backend("lightning_ipc", "lightning_vllm.backends.lightning_ipc.backend", "InPlaceIPCBackend")
register_backend("lightning_nccl", "lightning_vllm.backends.lightning_nccl.backend", "StagedNCCLBackend")


def names() -> list[str]:
    """Every name a push may ask for: ``"auto"`` and the registered backends."""
    return [AUTO, *_REGISTRY]


def carrying(trait: str) -> list[str]:
    """The registered backends whose :class:`~lightning_vllm.backends.base.Traits` ``trait`` holds (for
    errors that say which backend would do)."""
    return [name for name in _REGISTRY if getattr(backend_named(name).traits, trait)]


def check_requested(backend: str, every_rank: bool = False) -> None:
    """Raise ``ValueError`` for a backend no one registered, or one that cannot take every trainer
    rank's share when ``every_rank`` (``push_from="every_rank"``) asks for it.

    Example::

        >>> check_requested("mpi")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Invalid value for backend='mpi'. Must be one of 'auto', 'gloo', 'nccl', 'ipc'...
    """
    if backend not in names():
        raise ValueError(f"Invalid value for backend={backend!r}. Must be one of {', '.join(map(repr, names()))}.")
    if every_rank and backend != AUTO and not backend_named(backend).traits.carries_shares:
        raise ValueError(
            f"push_from='every_rank' sends each trainer rank's share, which backend={backend!r} cannot carry. "
            f"Pass push_from='rank0', or backend={carrying('carries_shares')[0]!r}."
        )


def backend_named(name: str) -> Backend:
    """The backend registered as ``name``.

    Raises:
        ValueError: no backend has that name.
    """
    if name not in _REGISTRY:
        check_requested(name)
        raise ValueError(f"'auto' is not a backend: pick one ({', '.join(map(repr, _REGISTRY))}).")
    module, class_name = _REGISTRY[name]
    backend: Backend = getattr(importlib.import_module(module), class_name)()
    return backend


def backend_for_engine(requested: str, configured: str | None, engine: str) -> Backend:
    """The backend to push with to an engine built with ``configured`` (its ``weight_transfer_config``):
    ``"auto"`` follows the engine, rather than the trainer's hardware, since the engine's config is
    the one fact both sides must agree on.

    Raises:
        EngineConfigError: the engine has no weight-transfer config, or another backend than
            ``requested``; the message says how to build it.
        ValueError: ``requested`` names no backend.
    """
    check_requested(requested)
    if configured is None:
        suggested = "gloo" if requested == AUTO else requested
        raise EngineConfigError(
            f"The {engine} engine was built without a weight-transfer config, so it cannot receive "
            f"weights. Build it with weight_transfer_config={{'backend': '{suggested}'}}."
        )
    chosen = configured if requested == AUTO else requested
    if configured != chosen:
        raise EngineConfigError(
            f"The {engine} engine expects weight-transfer backend {configured!r} but this updater "
            f"uses {chosen!r}. Build the engine with weight_transfer_config={{'backend': '{chosen}'}} or pass "
            f"backend={configured!r} to the updater."
        )
    if configured not in _REGISTRY:
        raise EngineConfigError(
            f"The {engine} engine uses weight-transfer backend {configured!r}, which lightning-vllm does not send "
            f"over. Build it with one of {', '.join(map(repr, _REGISTRY))}."
        )
    return backend_named(configured)
