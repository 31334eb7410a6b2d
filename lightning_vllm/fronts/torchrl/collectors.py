"""TorchRL's side of an updater that is not a push: its registration as TorchRL's ``WeightUpdaterBase``, and what
it needs of the collector it belongs to (the collector's policy version, its policy's engine, whether that policy can
sample from a pushed LoRA adapter). ``updater.py`` uses them."""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

log = logging.getLogger(__name__)


@functools.cache
def torchrl_updater_base() -> type | None:
    """TorchRL's ``WeightUpdaterBase`` when torchrl is installed and imports, else ``None``.

    Looked up once per process, and only when an updater is built: vLLM imports this
    package in each of its processes (the transport plugin), which need no torchrl.
    """
    if importlib.util.find_spec("torchrl") is None:
        return None
    try:
        from torchrl.collectors import WeightUpdaterBase
    except Exception as error:  # a broken torchrl must not stop pushes that do not use it
        log.warning(
            "torchrl is installed but does not import (%s: %s); VLLMUpdater is not registered as a TorchRL "
            "WeightUpdaterBase, so TorchRL's collectors will not take it. docs/torchrl.md lists the tested versions.",
            type(error).__name__,
            error,
        )
        return None
    return cast(type, WeightUpdaterBase)


def register_with_torchrl(updater_class: type) -> None:
    """Register ``updater_class`` as a (virtual) subclass of TorchRL's ``WeightUpdaterBase``.

    Registered rather than inherited: a subclass would import torchrl with this package
    (in every vLLM process too) and TorchRL warns at the creation of each subclass that
    the base is deprecated. Collectors check ``isinstance``; registration satisfies it.
    """
    base = torchrl_updater_base()
    if base is not None and not issubclass(updater_class, base):
        cast(Any, base).register(updater_class)


def policy_engine(collector: Any) -> Any:
    """The engine ``collector``'s policy generates with (a TorchRL ``vLLMWrapper`` keeps it as ``policy.model``), or
    ``None``."""
    return getattr(getattr(collector, "policy", None), "model", None)


class CollectorVersion:
    """Moves a registered collector's policy version by exactly one per successful push.

    A push made through the collector's ``update_policy_weights_`` may be counted by the
    collector itself (TorchRL's single-process collectors bump their version after calling
    the updater; its multi-process ones do not), so during such a call the push is only
    noted, and the version is bumped after the call if the collector did not move it. A
    push made by calling the updater directly bumps the version at once. The collector is
    held weakly; its ``update_policy_weights_`` is wrapped on the instance.
    """

    def __init__(self, collector: Any) -> None:
        self._collector = weakref.ref(collector)
        self._in_call = threading.local()  # per thread: a collector's call and our push share one
        update = getattr(collector, "update_policy_weights_", None)
        if callable(update):
            collector.update_policy_weights_ = self._counted(update)

    def __call__(self) -> None:
        """The post hook: count one successful push."""
        if getattr(self._in_call, "active", False):
            self._in_call.pushes += 1
            return
        collector = self._collector()
        if collector is not None:
            collector.increment_version()

    def _counted(self, update: Callable[..., Any]) -> Callable[..., Any]:
        collector_ref = self._collector  # not the collector itself: the wrapper lives on it

        @functools.wraps(update)
        def update_policy_weights_(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._in_call, "active", False):  # nested: the outer call counts
                return update(*args, **kwargs)
            collector = collector_ref()
            before = getattr(collector, "policy_version", None)
            self._in_call.active, self._in_call.pushes = True, 0
            try:
                result = update(*args, **kwargs)
            finally:
                self._in_call.active = False
            if self._in_call.pushes and collector is not None and getattr(collector, "policy_version", None) == before:
                collector.increment_version()
            return result

        return update_policy_weights_


def adapter_consumer_problems(collector: Any) -> list[str]:
    """Why ``collector`` cannot sample from a pushed LoRA adapter: its policy (a TorchRL ``vLLMWrapper``, say) calls
    vLLM itself, without the adapter's ``LoRARequest``."""
    policy = getattr(collector, "policy", None)
    if policy is None:
        return []
    return [
        f"the registered collector's policy ({type(policy).__name__}) generates without the adapter's "
        "LoRA request, so it would sample from the base weights"
    ]
