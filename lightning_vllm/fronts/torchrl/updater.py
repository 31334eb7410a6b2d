"""TorchRL's front end: ``VLLMUpdater``, which has a core (``core/weight_sync.py``) and speaks TorchRL's names.

The names TorchRL's collectors and ``WeightUpdaterBase`` call (the constructor's
``master_address``/``master_port``/``model_metadata``/``vllm_tp_size``, ``init``,
``push_weights`` with worker ids, construction from a policy, the registered collector,
TorchRL's version counting, ``__call__`` and the private ``_get_server_weights`` /
``_maybe_map_weights`` / ``_sync_weights_with_worker`` / ``_skip_update``), each one a push or
a question of its core; its registration among TorchRL's updaters and what it needs of its collector are
``collectors.py``'s. The Lightning callback is the other front end, beside this one, and may push through the same
core. See ``docs/torchrl.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from typing_extensions import Self

from lightning_vllm.core.push import EngineSelection, SyncStats
from lightning_vllm.core.versions import WeightVersions
from lightning_vllm.core.weight_sync import WeightSync, refuse_option_attribute
from lightning_vllm.engines import EngineTarget, as_engine_targets
from lightning_vllm.engines.sleep import sleep_engines, wake_engines
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.fronts.torchrl.collectors import (
    CollectorVersion,
    adapter_consumer_problems,
    policy_engine,
    register_with_torchrl,
)
from lightning_vllm.options import LoraMode, PauseMode, SleepLevel, UpdaterOptions
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_TIMEOUT_SECONDS
from lightning_vllm.weights import source_metadata, weights_from
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import ModelMetadata


class VLLMUpdater:
    """TorchRL's front end: a :class:`~lightning_vllm.core.weight_sync.WeightSync` (:attr:`weight_sync`, the core) and
    its pushes under the names of TorchRL's ``torchrl.collectors.llm.vLLMUpdater`` (its constructor, ``init``,
    ``push_weights``, worker ids, collectors, version counting), so code written for TorchRL finds
    the names it knows. Registered as TorchRL's ``WeightUpdaterBase`` (docs/torchrl.md). The Lightning callback
    given this updater (``VLLMWeightSync(updater=...)``) pushes through the same core.

    For each engine the updater joins one collective group with its workers, checks before any
    byte moves that the engine and the weights fit, and after each successful push commits a new
    weight version in the engine and resets its prefix cache (see ``WeightSync``).

    Args:
        master_address: address the trainer listens on for the rendezvous; the engine's
            workers must reach it there. Defaults to ``127.0.0.1`` (loopback).
        master_port: port for the rendezvous; ``None`` picks a free one. With several engines,
            engine ``i`` (its worker id) listens on ``master_port + i``.
        model_metadata: ``{name: (dtype, shape)}`` of the weights to send, dtypes being
            the engine's serving dtypes; taken from the first pushed model when ``None``.
        vllm_tp_size: vLLM's tensor-parallel size; checked against the engine when given.
        engine: the vLLM engine(s) to update: a ``vllm.LLM``, an ``AsyncLLM``, a server URL
            (``"http://host:port"``), a Ray actor handle of ``VLLMActor``, any
            ``EngineTarget``, or a list mixing them (worker ids are list positions).
        backend: ``"auto"`` (the backend of each engine's ``weight_transfer_config``), ``"gloo"``,
            ``"nccl"``, ``"ipc"``, ``"lightning_ipc"`` (vLLM's IPC protocol with each handle sent once, loaded
            by the workers with one batched copy: ``docs/gpu.md``) or ``"lightning_nccl"`` (vLLM's NCCL protocol,
            each push staged by the workers and committed whole); must match the engine's
            ``weight_transfer_config``.
        bucket_size_bytes: largest packed bucket on the wire, which bounds the trainer's
            extra memory during a push.
        timeout_seconds: the longest any single wait (rendezvous, transfer, control call) may take;
            with ``nccl`` and ``ipc``, whose waits are NCCL's and CUDA's, the whole transfer of a push.
        model_attribute: attribute of a LightningModule that holds the Hugging Face model;
            found automatically when ``None``.
        reset_prefix_cache: reset vLLM's prefix cache after each push.
        pause_mode: how engines that serve while training (``AsyncLLM``, servers) treat
            requests in flight during a push: ``"keep"`` freezes and resumes them (nothing
            lost), ``"wait"`` finishes them first, ``"abort"`` drops them.
        lora: how a PEFT LoRA policy is pushed: ``"adapter"`` sends the adapter alone (the
            first push of each connection also sends the base weights once) and the engines
            generate through it; ``"merged"`` sends merged full weights; ``"auto"`` sends the
            adapter when every engine can serve it (``enable_lora=True``, gloo) and merged
            weights otherwise. See ``docs/lora.md``.
        changed_only: send only the layer groups with a tensor written since this updater's last
            push to the engine (PyTorch counts in-place writes; writes through ``.data`` are not
            counted); the engine keeps the others. See ``docs/concepts.md``.
        verify_pushes: after each push, hold the per-layer fingerprints of what every engine now
            holds against those of what was sent (exact integer sums, ``weights/layer_sums.py``), and
            raise ``LandedWeightsMismatchError`` naming the layers that differ. On by default; ``False``
            saves its cost (``docs/concepts.md`` gives it) and gives up noticing a push that committed
            wrong weights. The workers are asked through ``collective_rpc``, by the methods our vLLM plugin
            gives every worker (``in_vllm/worker_methods.py``): no flag is needed. Workers that did not load
            the plugin are named once, at connect, with the fix, and their pushes are not checked.
        sleep_level: the level :meth:`sleep` puts engines built with ``enable_sleep_mode=True`` at (``1``: weights
            kept in host memory, ``2``: dropped); pushes then leave the weights awake. Every push wakes a sleeping
            engine's weights first, whatever this is (``docs/sleep.md``).

    Example::

        >>> from vllm import LLM  # doctest: +SKIP
        >>> llm = LLM(model=path, dtype="float32", weight_transfer_config={"backend": "gloo"})  # doctest: +SKIP
        >>> updater = VLLMUpdater(engine=llm)  # doctest: +SKIP
        >>> updater.init(VLLMUpdater.get_model_metadata(hf_model))  # doctest: +SKIP
        >>> updater.push_weights(hf_model)  # doctest: +SKIP
        >>> updater.weight_version, llm.get_weight_version()  # doctest: +SKIP
        (1, '1')
    """

    def __init__(
        self,
        master_address: str | None = None,
        master_port: int | None = None,
        model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None = None,
        vllm_tp_size: int | None = None,
        *,
        engine: Any = None,
        backend: str = "auto",
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        model_attribute: str | None = None,
        reset_prefix_cache: bool = True,
        pause_mode: PauseMode = "keep",
        lora: LoraMode = "auto",
        changed_only: bool = True,
        verify_pushes: bool = True,
        sleep_level: SleepLevel | None = None,
    ) -> None:
        options = UpdaterOptions.among(locals())
        self.weight_sync = WeightSync(engine, options=options, model_metadata=model_metadata)
        self._collector_ref: weakref.ref[Any] | None = None
        register_with_torchrl(type(self))  # TorchRL's collectors then take it (docs/torchrl.md)

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_option_attribute(self, name)
        super().__setattr__(name, value)

    # -- the core's, under the names our docs and TorchRL's use --------------------

    @property
    def options(self) -> UpdaterOptions:
        """The settings this pushes with (``WeightSync.options``; change them with :meth:`set_options`)."""
        return self.weight_sync.options

    def set_options(self, **changes: Any) -> None:
        """``WeightSync.set_options``: push with ``changes`` to the options from now on."""
        self.weight_sync.set_options(**changes)

    @property
    def engine(self) -> EngineTarget | None:
        """The target of the first engine (the only one, usually)."""
        return self.weight_sync.engine

    @property
    def engines(self) -> list[EngineTarget]:
        """The targets of every engine, in worker-id order."""
        return self.weight_sync.engines

    def set_engine(self, engine: Any) -> None:
        """Replace the engine(s) this pushes to (leaving any group formed with the old ones)."""
        self.weight_sync.set_engine(engine)

    @property
    def initialized(self) -> bool:
        """Whether a group is formed with every engine."""
        return self.weight_sync.initialized

    def engine_versions(self) -> dict[int, str | None]:
        """The weight version each engine reports, by worker id."""
        return self.weight_sync.engine_versions()

    @property
    def model_metadata(self) -> ModelMetadata | None:
        """``{name: (dtype, shape)}`` of what is sent (``None`` until given or taken from the first push)."""
        return self.weight_sync.model_metadata

    @property
    def versions(self) -> WeightVersions:
        """The weight versions (``core/versions.py``)."""
        return self.weight_sync.versions

    @property
    def weight_version(self) -> int:
        """The version of the weights last pushed (0 before the first push)."""
        return self.weight_sync.weight_version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self.weight_sync.weight_version = value

    @property
    def last_sync(self) -> SyncStats | None:
        """The figures of the last push that landed as sent (``None`` before one)."""
        return self.weight_sync.last_sync

    def register_post_hook(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` after every push that commits a version, in registration order (``WeightSync``'s)."""
        self.weight_sync.register_post_hook(hook)

    @property
    def post_hooks(self) -> list[Callable[[], Any]]:
        """The hooks run after each push that commits a version."""
        return self.weight_sync.post_hooks

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to pass to ``llm.generate`` to sample from the policy's adapter (``None`` before an
        adapter push, and when merged weights are pushed)."""
        return self.weight_sync.lora_request

    def sleep(self) -> None:
        """Put every engine to sleep at ``sleep_level``, for training's turn; the next push wakes the weights alone
        (every layer is sent after level 2), :meth:`wake_up` the rest, for the collector's turn."""
        if (level := self.options.sleep_level) is None:
            raise ValueError("VLLMUpdater.sleep() needs a level: pass sleep_level=1 or 2 to VLLMUpdater.")
        sleep_engines(self.engines, level, self.options.pause_mode, self.options.timeout_seconds)

    def wake_up(self) -> None:
        """Wake every engine for rollouts (``WeightsDroppedError``: weights dropped, and no push landed since)."""
        wake_engines(self.engines, self.options.timeout_seconds)

    def close(self) -> None:
        """Leave every group and release the engines' side of them; the engines keep serving."""
        self.weight_sync.close()

    # -- TorchRL's names ------------------------------------------------------------

    @property
    def master_address(self) -> str:
        """The address the trainer listens on for the rendezvous (loopback unless given)."""
        return self.options.address

    @property
    def master_port(self) -> int | None:
        """The rendezvous port (engine ``i`` listens on ``master_port + i``); ``None``: a free one."""
        return self.options.master_port

    @property
    def vllm_tp_size(self) -> int | None:
        """vLLM's tensor-parallel size, checked against each engine when given."""
        return self.options.vllm_tp_size

    def init(self, model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None = None) -> None:
        """TorchRL's name of :meth:`~lightning_vllm.core.weight_sync.WeightSync.connect`: check the metadata
        against each engine's model and join a group with each engine's workers."""
        self._find_engines()
        self.weight_sync.connect(model_metadata)

    def all_worker_ids(self) -> list[int]:
        """Ids of the engines this updater can push to: their positions in ``engine`` (TorchRL's name)."""
        return self.weight_sync.engine_indices()

    def push_weights(self, policy_or_weights: Any = None, worker_ids: EngineSelection = None) -> SyncStats:
        """Send weights to vLLM and commit them as a new version (TorchRL's name of ``WeightSync.push``).

        Args:
            policy_or_weights: a Hugging Face or PEFT model, a LightningModule holding one,
                a dict of tensors or a TensorDict (nested keys joined with ``"."``).
            worker_ids: engines to update, by id (see :meth:`all_worker_ids`) or by device
                (the engines on that device type); all when ``None``.

        Returns:
            The version pushed, the seconds it took and the bytes sent.

        Raises:
            WeightsMismatchError: the weights do not fit an engine's model; nothing is sent.
            PartialPushError: some engines took the push, some did not.
            WeightSyncError: no engine took it; every engine keeps its previous version.
        """
        weights = policy_or_weights if policy_or_weights is not None else self._get_server_weights()
        self._find_engines()
        return self.weight_sync.push(weights, worker_ids)

    def __call__(self, policy_or_weights: Any = None, worker_ids: EngineSelection = None) -> SyncStats:
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
        return weights_from(server_weights, self.options.model_attribute)

    def _sync_weights_with_worker(
        self, *, worker_id: int | torch.device | None = None, server_weights: Any = None, version: int | None = None
    ) -> None:
        """Push ``server_weights`` to one engine (``None``: every engine), as TorchRL's updaters name the
        per-worker step of ``WeightUpdaterBase.push_weights``: the same push as :meth:`push_weights`, with
        its checks, its commit and its post hooks. The version is the updater's next; ``version``, if
        given, must be that one (a version names one set of weights)."""
        if version is not None and version != self.weight_sync.versions.next:
            raise ValueError(
                f"version={version} cannot be committed: the next weight version is {self.weight_sync.versions.next} "
                "(versions only move one push at a time). Leave version=None, or set updater.weight_version first."
            )
        self.push_weights(server_weights, worker_id)

    def _skip_update(self, worker_id: int | torch.device) -> bool:
        """Whether TorchRL's ``WeightUpdaterBase.push_weights`` leaves engine ``worker_id`` out: never (a
        push goes to every engine it names; one that fails joins again at the next push)."""
        return False

    def _find_engines(self) -> None:
        """Without an engine given: push to the engine of the registered collector's policy (a TorchRL
        ``vLLMWrapper`` keeps it as ``policy.model``), as TorchRL's own vLLMUpdater finds it; none without a
        collector (a push then says to pass one)."""
        engine = None if self.weight_sync.engines else policy_engine(self.collector)
        if engine is None:
            return
        try:
            self.weight_sync.set_engine(as_engine_targets(engine))
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
        return cls(model_metadata=metadata)

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
        self.weight_sync.set_adapter_consumer_problems(adapter_consumer_problems(collector))

    @property
    def collector(self) -> Any:
        """The registered collector, or ``None`` if none was registered or it is gone."""
        return self._collector_ref() if self._collector_ref is not None else None

    @property
    def collectors(self) -> list[Any] | None:
        """The registered collector in a list (TorchRL's spelling), or ``None`` before one registers."""
        return None if self._collector_ref is None else [self._collector_ref()]


vLLMUpdater = VLLMUpdater
"""TorchRL's spelling of the same class."""
