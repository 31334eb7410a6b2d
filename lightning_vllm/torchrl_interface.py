"""What TorchRL's collectors call on an updater: construction from a policy, weight versions,
post hooks, the collector, worker ids.

Kept apart from the updater's pushing so the collector-facing surface, which follows
TorchRL's ``WeightUpdaterBase``, reads in one place.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from typing_extensions import Self

from lightning_vllm.engines import EngineTarget
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.weights import ModelMetadata, source_metadata, weights_from


class TorchRLInterface:
    """Construction from a policy, versions, post hooks and the registered collector of
    :class:`~lightning_vllm.VLLMUpdater`."""

    _version: int
    _post_hooks: list[Callable[[], Any]]
    _collector_ref: weakref.ref[Any] | None
    _engines: list[EngineTarget]

    def _require_engines(self) -> None:
        if not self._engines:
            raise EngineConfigError("No vLLM engine to push to: pass engine=... (e.g. a vllm.LLM) to VLLMUpdater.")

    @classmethod
    def from_policy(cls, policy: Any) -> Self | None:
        """An updater for ``policy`` if it holds a Hugging Face model vLLM can serve, else ``None``.

        The updater carries the policy's metadata; give it an engine before the first push.
        """
        if not isinstance(policy, torch.nn.Module):
            return None
        try:
            metadata = cls.get_model_metadata(policy)
        except (TypeError, ValueError):
            return None
        updater: Self = cast(Any, cls)(model_metadata=metadata)  # VLLMUpdater's constructor
        return updater

    @classmethod
    def get_model_metadata(cls, model: Any, model_attribute: str | None = None) -> ModelMetadata:
        """``{name: (dtype, shape)}`` of what would be sent for ``model``, read without copying a tensor.

        Args:
            model: a Hugging Face or PEFT model, a LightningModule holding one, a dict or a TensorDict.
            model_attribute: the LightningModule attribute holding the model, if not found automatically.
        """
        return source_metadata(weights_from(model, model_attribute))

    @property
    def weight_version(self) -> int:
        """The version of the weights last pushed (0 before the first push)."""
        return self._version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"Invalid value for weight_version={value}. Must be >= 0.")
        self._version = int(value)

    def increment_version(self) -> None:
        """Count one more weight version without pushing (TorchRL's collectors call this)."""
        self._version += 1

    def register_post_hook(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` after every successful push, in registration order; never after a failed one."""
        if not callable(hook):
            raise TypeError(f"A post hook must be callable, got {type(hook).__name__}.")
        self._post_hooks.append(hook)

    @property
    def post_hooks(self) -> list[Callable[[], Any]]:
        """The hooks run after each successful push."""
        return list(self._post_hooks)

    def register_collector(self, collector: Any) -> None:
        """Attach the collector (or any container) that owns this updater, once.

        It is held weakly. As in TorchRL, its ``increment_version`` (if any) runs after
        each successful push, for as long as the collector lives.

        Raises:
            RuntimeError: a collector is already registered.
        """
        if self._collector_ref is not None:
            raise RuntimeError("Cannot register collector twice.")
        self._collector_ref = weakref.ref(collector)
        if hasattr(collector, "increment_version"):
            increment = weakref.WeakMethod(collector.increment_version)

            def increment_collector_version() -> None:
                method = increment()
                if method is not None:
                    method()

            self.register_post_hook(increment_collector_version)

    @property
    def collector(self) -> Any:
        """The registered collector, or ``None`` if none was registered or it is gone."""
        return self._collector_ref() if self._collector_ref is not None else None

    # -- worker ids ------------------------------------------------------------------

    def all_worker_ids(self) -> list[int]:
        """Ids of the engines this updater can push to: their positions in ``engine``."""
        return list(range(len(self._engines)))

    def _resolve_worker_ids(self, worker_ids: int | torch.device | Sequence[int | torch.device] | None) -> list[int]:
        self._require_engines()
        known = self.all_worker_ids()
        if worker_ids is None:
            return known
        requested = [worker_ids] if isinstance(worker_ids, (int, torch.device)) else list(worker_ids)
        resolved: list[int] = []
        for worker in requested:
            if isinstance(worker, torch.device):
                resolved += [i for i in known if self._engines[i].device_type() == worker.type]
            elif worker in known:
                resolved.append(worker)
            else:
                raise ValueError(f"Unknown worker id {worker!r}; this updater's engines are {known}.")
        if not resolved:
            raise ValueError(f"worker_ids={worker_ids!r} selects no engine; this updater's engines are {known}.")
        return sorted(set(resolved))
