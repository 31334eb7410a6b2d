"""What TorchRL's collectors call on an updater: weight versions, post hooks, the collector.

Kept apart from the updater's pushing so the collector-facing surface, which follows
TorchRL's ``WeightUpdaterBase``, reads in one place.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


class TorchRLInterface:
    """Versions, post hooks and the registered collector of :class:`~lightning_vllm.VLLMUpdater`."""

    _version: int
    _post_hooks: list[Callable[[], Any]]
    _collector_ref: weakref.ref[Any] | None

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
