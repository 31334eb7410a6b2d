"""TorchRL's surface of the updater, and nothing else: the names TorchRL's collectors and
``WeightUpdaterBase`` call (construction from a policy, the registered collector, TorchRL's
version counting, ``__call__`` and the private ``_get_server_weights`` / ``_maybe_map_weights``
/ ``_sync_weights_with_worker``), each delegating to the updater's own machinery; and the
updater's place among TorchRL's updaters. Versions, hooks and engines are the updater's
(``updater.py``, ``versions.py``, ``engine_set.py``). See ``docs/torchrl.md``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, cast

import torch
from typing_extensions import Self

from lightning_vllm.core.engine_set import EngineSet, SyncStats, WorkerIds
from lightning_vllm.core.versions import WeightVersions
from lightning_vllm.engines import EngineTarget, as_engine_targets
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.weights import source_metadata, weights_from
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import ModelMetadata
from lightning_vllm.weights.payload import Payload

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


class TorchRLInterface(ABC):
    """TorchRL's surface of :class:`~lightning_vllm.VLLMUpdater`: construction from a policy, the
    registered collector (its policy version moves with each push) and TorchRL's version counting.
    Versions, post hooks and engines are the updater's own; this class only reaches them."""

    versions: WeightVersions
    model_attribute: str | None
    _collector_ref: weakref.ref[Any] | None
    _engine_set: EngineSet

    # The updater's own machinery, which TorchRL's names delegate to (``VLLMUpdater`` implements it).
    @abstractmethod
    def register_post_hook(self, hook: Callable[[], Any]) -> None: ...

    @abstractmethod
    def push_weights(self, policy_or_weights: Any = None, worker_ids: WorkerIds = None) -> SyncStats: ...

    @abstractmethod
    def choose_payload(self, weights: Any) -> Payload: ...

    def __call__(
        self,
        policy_or_weights: Any = None,
        worker_ids: WorkerIds = None,
    ) -> SyncStats:
        """Same as :meth:`push_weights`: TorchRL's collectors call their updater with these keywords."""
        return self.push_weights(policy_or_weights, worker_ids)

    @classmethod
    def get_model_metadata(cls, model: Any, model_attribute: str | None = None) -> ModelMetadata:
        """``{name: (dtype, shape)}`` of what would be sent for ``model``, read without copying a tensor.

        Args:
            model: a Hugging Face or PEFT model, a LightningModule holding one, a dict or a TensorDict.
            model_attribute: the LightningModule attribute holding the model, if not found automatically.
        """
        return source_metadata(weights_from(model, model_attribute))

    def _get_server_weights(self) -> Any:
        """Not used, as in TorchRL's vLLMUpdater: weights must be passed to :meth:`push_weights`."""
        raise ValueError(
            "push_weights needs the weights: pass the policy (a Hugging Face model or a LightningModule holding one), "
            "a dict of tensors or a TensorDict. This updater does not fetch weights by itself."
        )

    def _maybe_map_weights(self, server_weights: Any) -> Weights:
        """Turn a model, a dict or a TensorDict into the named, streamed source the transport reads."""
        return weights_from(server_weights, self.model_attribute)

    def _sync_weights_with_worker(
        self, *, worker_id: int | torch.device | None = None, server_weights: Any = None, version: int | None = None
    ) -> None:
        """Push ``server_weights`` to one engine (``None``: every engine), as TorchRL's updaters name the
        per-worker step of ``WeightUpdaterBase.push_weights``: the same push as :meth:`push_weights`, with
        its checks, its commit and its post hooks. The version is the updater's next; ``version``, if
        given, must be that one (a version names one set of weights)."""
        if version is not None and version != self.versions.committed + 1:
            raise ValueError(
                f"version={version} cannot be committed: the next weight version is {self.versions.committed + 1} "
                "(versions only move one push at a time). Leave version=None, or set updater.weight_version first."
            )
        self.push_weights(server_weights, worker_id)

    def _skip_update(self, worker_id: int | torch.device) -> bool:
        """Whether TorchRL's ``WeightUpdaterBase.push_weights`` leaves engine ``worker_id`` out: never (a
        push goes to every engine it names; one that fails joins again at the next push)."""
        return False

    def _engines_of_collector(self) -> list[EngineTarget]:
        """The engine of the registered collector's policy (a TorchRL ``vLLMWrapper`` keeps it as
        ``policy.model``), as TorchRL's own vLLMUpdater finds it; none without a collector."""
        engine = getattr(getattr(self.collector, "policy", None), "model", None)
        if engine is None:
            return []
        try:
            return as_engine_targets(engine)
        except TypeError as error:
            raise EngineConfigError(
                f"The collector's policy generates with a {type(engine).__name__}, which this updater cannot push "
                f"to ({error}). Pass engine=... to VLLMUpdater, or build the policy on a vllm.LLM or AsyncLLM "
                "with weight_transfer_config={'backend': 'gloo'}."
            ) from error

    @classmethod
    def from_policy(cls, policy: Any) -> Self | None:
        """An updater for ``policy`` if it holds a Hugging Face model vLLM can serve, else ``None``.

        The updater carries the policy's metadata; give it an engine before the first push.
        """
        if not isinstance(policy, torch.nn.Module):
            return None
        try:
            metadata = source_metadata(weights_from(policy))
        except (TypeError, ValueError):
            return None
        updater: Self = cast(Any, cls)(model_metadata=metadata)  # VLLMUpdater's constructor
        return updater

    def increment_version(self) -> None:
        """Count one more version without pushing: this updater's weight version and, as
        TorchRL's updaters do, the registered collector's policy version."""
        self.versions.count_one()
        collector = self.collector
        if collector is not None and hasattr(collector, "increment_version"):
            collector.increment_version()

    def register_collector(self, collector: Any) -> None:
        """Attach the collector (or any container) that owns this updater, once.

        TorchRL's collectors call this when given the updater. The collector is held
        weakly; if it has ``increment_version``, its policy version moves by exactly one
        per successful push, whether the push comes through its ``update_policy_weights_``
        (which may count it itself) or from calling the updater directly. Without an
        ``engine``, the updater pushes to the engine of the collector's policy.

        Raises:
            RuntimeError: a collector is already registered.

        Example::

            >>> updater = vLLMUpdater(model_metadata=vLLMUpdater.get_model_metadata(hf_model))  # doctest: +SKIP
            >>> collector = LLMCollector(env=env, policy=vLLMWrapper(llm), weight_updater=updater)  # doctest: +SKIP
            >>> updater.collector is collector  # doctest: +SKIP
            True
            >>> collector.update_policy_weights_(hf_model)  # pushes into llm, the policy's engine  # doctest: +SKIP
            >>> collector.policy_version, updater.engine.llm is llm  # doctest: +SKIP
            (1, True)
        """
        if self._collector_ref is not None:
            raise RuntimeError(
                "Cannot register collector twice: this updater already belongs to a collector. "
                "Build one updater per collector."
            )
        self._collector_ref = weakref.ref(collector)
        if hasattr(collector, "increment_version"):
            self.register_post_hook(CollectorVersion(collector))

    @property
    def collector(self) -> Any:
        """The registered collector, or ``None`` if none was registered or it is gone."""
        return self._collector_ref() if self._collector_ref is not None else None

    @property
    def collectors(self) -> list[Any] | None:
        """The registered collector in a list (TorchRL's spelling), or ``None`` before one registers."""
        return None if self._collector_ref is None else [self._collector_ref()]

    def _collector_lora_problems(self) -> list[str]:
        """Why the registered collector cannot sample from a pushed LoRA adapter: its policy (a
        TorchRL ``vLLMWrapper``, say) calls vLLM itself, without the adapter's ``LoRARequest``."""
        policy = getattr(self.collector, "policy", None)
        if policy is None:
            return []
        return [
            f"the registered collector's policy ({type(policy).__name__}) generates without the adapter's "
            "LoRA request, so it would sample from the base weights"
        ]
