"""TorchRL's weight-sync scheme for vLLM (``torchrl.weight_update.llm.VLLMWeightSyncScheme``, torchrl 0.14), on the
core: the same constructor, sender and receiver, whose pushes are :class:`~lightning_vllm.VLLMUpdater`'s.

TorchRL 0.14.1's own scheme calls vLLM trainer APIs that vLLM 0.28 removed (``NCCLWeightTransferEngine.trainer_init``,
``trainer_send_weights``, ``NCCLTrainerSendWeightsArgs``) and needs CUDA; this one runs on every backend the updater
does (``gloo`` on CPUs, ``nccl``, ``ipc``, ``lightning_ipc``, ``lightning_nccl``), with its checks before any byte
moves, versions, atomic commits and timeouts. It imports torchrl: the package never imports this module itself (vLLM
imports the package in each of its processes); ``lightning_vllm.torchrl`` does. See ``docs/torchrl.md``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torchrl.weight_update import WeightSyncScheme

from lightning_vllm.core.push import SyncStats
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.fronts.torchrl.collectors import policy_engine
from lightning_vllm.fronts.torchrl.updater import VLLMUpdater
from lightning_vllm.weights.model import ModelMetadata

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class VLLMWeightSyncScheme(WeightSyncScheme):
    """TorchRL's ``VLLMWeightSyncScheme`` on lightning-vllm: the trainer's sender pushes into vLLM engines through a
    :class:`~lightning_vllm.VLLMUpdater`, over the backend of each engine's ``weight_transfer_config``.

    A ``torchrl.weight_update.WeightSyncScheme`` (a subclass), so TorchRL code that checks for one takes it, and the
    ``_target_`` of TorchRL's Hydra ``VLLMWeightSyncSchemeConfig`` can name it. The engine is named where TorchRL
    names it, at :meth:`VLLMWeightSender.init_all_workers_group`: a ``vllm.LLM``, an ``AsyncLLM``, a ``vllm serve``
    URL, a Ray actor of :class:`~lightning_vllm.VLLMActor`, or a list of them (one per replica).

    Args:
        master_address: the address the trainer listens on for the workers' rendezvous; loopback (``127.0.0.1``)
            when ``None``, where TorchRL's default is ``"localhost"``. Give the trainer's address when the engine's
            workers are on another host.
        master_port: the rendezvous port (replica ``i`` on ``master_port + i``); a free one when ``None``.
        gpus_per_replica: the workers of each engine (tensor x pipeline x data parallel), checked against each engine
            before any byte moves.
        num_replicas: how many engines are named, checked likewise.
        strategy: TorchRL's ``"tensordict"`` or ``"state_dict"``, kept (``strategy_name``) so that TorchRL's configs
            build this class unchanged. Unused: weights are pushed as given, a model as itself (its Hugging Face
            names, LoRA and tied weights handled by the updater), a dict or a TensorDict by its keys.
        device: TorchRL's CUDA device index for its NCCL group. Unused: the updater sends from where the weights
            are. Kept so that TorchRL's configs build this class unchanged.
        **updater_options: any keyword of :class:`~lightning_vllm.VLLMUpdater` after ``vllm_tp_size``
            (``timeout_seconds``, ``verify_pushes``, ``changed_only``, ``pause_mode``, ``backend``, ...).

    Example::

        >>> from lightning_vllm.torchrl import VLLMWeightSyncScheme, get_model_metadata  # doctest: +SKIP
        >>> scheme = VLLMWeightSyncScheme(master_port=29500, gpus_per_replica=1, num_replicas=1)  # doctest: +SKIP
        >>> sender = scheme.create_sender()  # doctest: +SKIP
        >>> sender.register_model(hf_model)  # doctest: +SKIP
        >>> sender.init_all_workers_group(get_model_metadata(hf_model), vllm_engine=llm)  # doctest: +SKIP
        >>> sender.update_weights()  # vLLM serves hf_model's weights as version 1  # doctest: +SKIP
    """

    def __init__(
        self,
        master_address: str | None = None,
        master_port: int | None = None,
        gpus_per_replica: int = 1,
        num_replicas: int = 1,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
        device: torch.device | str | int = 0,
        **updater_options: Any,
    ) -> None:
        super().__init__(strategy=strategy)
        for name, value in (("gpus_per_replica", gpus_per_replica), ("num_replicas", num_replicas)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int (got {value!r}).")
        unknown = sorted(set(updater_options) - set(_UPDATER_KEYWORDS))
        if unknown:
            raise TypeError(
                f"VLLMWeightSyncScheme got unexpected keyword(s) {unknown}: it takes TorchRL's arguments and "
                f"VLLMUpdater's options {sorted(_UPDATER_KEYWORDS)}."
            )
        self.master_address = master_address if master_address is not None else LOOPBACK
        self.master_port = master_port
        self.gpus_per_replica = gpus_per_replica
        self.num_replicas = num_replicas
        self.strategy_name = strategy
        self.device = device
        self.updater_options = dict(updater_options)
        self._sender: VLLMWeightSender | None = None

    @property
    def world_size(self) -> int:
        """TorchRL's group size: the trainer and every replica's workers."""
        return 1 + self.num_replicas * self.gpus_per_replica

    def create_sender(self) -> VLLMWeightSender:
        """The trainer's side: a :class:`VLLMWeightSender` (the scheme's :meth:`send` uses the last one made)."""
        self._sender = VLLMWeightSender(self)
        return self._sender

    def create_receiver(self, vllm_engine: Any) -> VLLMWeightReceiver:
        """The engine's side. It needs nothing of you: lightning-vllm's plugin is in vLLM's workers, and the sender's
        :meth:`~VLLMWeightSender.init_all_workers_group` has them join. See :class:`VLLMWeightReceiver`."""
        return VLLMWeightReceiver(self, vllm_engine)

    def create_transport(self, **kwargs: Any) -> Any:
        """Refused: there is no transport apart from the sender, whose updater makes the group with each engine's
        workers (TorchRL's own scheme makes its transport in the sender too).

        Raises:
            RuntimeError: always, naming the calls to make instead.
        """
        raise RuntimeError(
            "lightning_vllm's VLLMWeightSyncScheme has no separate transport: use create_sender() and its "
            "init_all_workers_group(metadata, vllm_engine=...), which joins the engine's workers."
        )

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """TorchRL's generic scheme call (``collector.update_policy_weights_`` with ``weight_sync_schemes``): push
        ``weights`` (or the registered model) through the sender made last, to the replicas ``worker_ids``."""
        if self._sender is None:
            raise RuntimeError(
                "No sender yet: call create_sender(), register_model(model) and init_all_workers_group(metadata, "
                "vllm_engine=...) before sending."
            )
        self._sender.update_weights(weights, worker_ids=worker_ids)


class VLLMWeightSender:
    """TorchRL's ``VLLMWeightSender`` on a :class:`~lightning_vllm.VLLMUpdater`: ``register_model``,
    ``register_collector``, ``init_all_workers_group``, ``update_weights``, ``shutdown``.

    After each push that landed, every registered collector's policy version moves by one (as TorchRL's sender does),
    and the updater's weight version is the engines'. Made by :meth:`VLLMWeightSyncScheme.create_sender`.
    """

    def __init__(self, scheme: VLLMWeightSyncScheme) -> None:
        self._scheme = scheme
        self._model_ref: weakref.ref[Any] | None = None
        self._collectors: list[Any] = []
        self._post_hooks: list[Callable[[], Any]] = []
        self._updater: VLLMUpdater | None = None

    @property
    def updater(self) -> VLLMUpdater | None:
        """The updater that pushes (``None`` before :meth:`init_all_workers_group`)."""
        return self._updater

    @property
    def weight_version(self) -> int:
        """The version of the last push that landed (0 before one)."""
        return 0 if self._updater is None else self._updater.weight_version

    def register_collector(self, collector: Any) -> None:
        """Have ``collector``'s policy version (``increment_version``) move by one after each push that landed."""
        self._collectors.append(collector)
        if not self._post_hooks:
            self._post_hooks.append(self._increment_all_collector_versions)

    def _increment_all_collector_versions(self) -> None:
        for collector in self._collectors:
            try:
                collector.increment_version()
            except Exception as error:  # noqa: BLE001  # as TorchRL's sender: one collector must not stop the rest
                log.warning("Failed to increment the policy version of %s: %s", type(collector).__name__, error)

    def register_model(self, model: Any) -> None:
        """The model :meth:`update_weights` pushes when given nothing (held weakly, as by TorchRL): a Hugging Face or
        PEFT model, a LightningModule holding one, a dict or a TensorDict."""
        self._model_ref = weakref.ref(model)

    def init_all_workers_group(
        self, model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None, vllm_engine: Any | None = None
    ) -> None:
        """Check the engine(s) and ``model_metadata`` against each other, then join a group with every engine's
        workers (they join from vLLM's side at the same time; nothing else is run there).

        Args:
            model_metadata: ``{name: (dtype, shape)}`` (:func:`get_model_metadata`); ``None``: the registered
                model's.
            vllm_engine: a ``vllm.LLM``, an ``AsyncLLM``, a ``vllm serve`` URL, a Ray actor of ``VLLMActor``, or a
                list of them, one per replica; ``None``: the engine of the first registered collector's policy (a
                TorchRL ``vLLMWrapper`` keeps it as ``policy.model``).

        Raises:
            EngineConfigError: no engine, an engine that cannot take pushes, or one whose replicas or workers are
                not the scheme's ``num_replicas`` and ``gpus_per_replica``; nothing was sent.
        """
        scheme = self._scheme
        engine = vllm_engine if vllm_engine is not None else self._collector_engine()
        if model_metadata is None and self._model_ref is not None and self._model_ref() is not None:
            model_metadata = VLLMUpdater.get_model_metadata(self._model_ref())
        try:
            updater = VLLMUpdater(
                master_address=scheme.master_address,
                master_port=scheme.master_port,
                model_metadata=model_metadata,  # (checked against the engines by init below)
                engine=engine,
                **scheme.updater_options,
            )
        except TypeError as error:  # an engine of another kind (TorchRL's Ray-based AsyncVLLM, say)
            raise EngineConfigError(f"The scheme's vllm_engine ({type(engine).__name__}): {error}") from error
        try:
            self._check_layout(updater)
            updater.init()
        except BaseException:
            updater.close()
            raise
        if self._updater is not None:
            self._updater.close()
        self._updater = updater

    def _collector_engine(self) -> Any:
        for collector in self._collectors:
            engine = policy_engine(collector)
            if engine is not None:
                return engine
        raise EngineConfigError(
            "VLLMWeightSender.init_all_workers_group needs the vLLM engine: pass vllm_engine= (a vllm.LLM, an "
            "AsyncLLM, a vllm serve URL or a VLLMActor), or register a collector whose policy generates with one."
        )

    def _check_layout(self, updater: VLLMUpdater) -> None:
        """The engines named are the scheme's ``num_replicas``, each with ``gpus_per_replica`` workers."""
        scheme, engines = self._scheme, updater.engines
        if len(engines) != scheme.num_replicas:
            raise EngineConfigError(
                f"VLLMWeightSyncScheme(num_replicas={scheme.num_replicas}) but {len(engines)} engine(s) were given: "
                "pass one engine per replica (a list), or set num_replicas to their number."
            )
        for index, engine in enumerate(engines):
            workers = engine.num_workers()
            if workers != scheme.gpus_per_replica:
                raise EngineConfigError(
                    f"VLLMWeightSyncScheme(gpus_per_replica={scheme.gpus_per_replica}) but replica {index} "
                    f"({engine.description}) runs {workers} worker(s) (tensor x pipeline x data parallel): set "
                    f"gpus_per_replica={workers}."
                )

    def update_weights(self, weights: Any | None = None, worker_ids: int | list[int] | None = None) -> SyncStats:
        """Push ``weights`` (or the registered model) into every engine, commit them as the next version, then move
        each registered collector's policy version by one.

        Args:
            weights: a model (Hugging Face, PEFT, LightningModule), a dict of tensors or a TensorDict; ``None``: the
                registered model.
            worker_ids: the replicas to update, by position; all when ``None``.

        Returns:
            The version pushed, its seconds and bytes (TorchRL's sender returns nothing).

        Raises:
            RuntimeError: :meth:`init_all_workers_group` was not called, or the registered model is gone.
        """
        if self._updater is None:
            raise RuntimeError("Transport not initialized. Call init_all_workers_group first.")
        if weights is None:
            model = self._model_ref() if self._model_ref is not None else None
            if model is None:
                raise RuntimeError(
                    "No weights to send: pass them to update_weights, or register_model(model) first (the model is "
                    "held weakly; it is gone)."
                )
            weights = model
        stats = self._updater.push_weights(weights, worker_ids=worker_ids)
        for hook in self._post_hooks:
            hook()
        return stats

    def shutdown(self) -> None:
        """Leave the engines' groups and forget the collectors (the engines keep serving their weights)."""
        if self._updater is not None:
            self._updater.close()
            self._updater = None
        self._collectors.clear()
        self._post_hooks.clear()


class VLLMWeightReceiver:
    """TorchRL's ``VLLMWeightReceiver``. Nothing to run on the engine's side: lightning-vllm's plugin is already in
    vLLM's workers, and they join the group and load each push when the sender's calls reach them. So
    :meth:`init_all_workers_group` only checks that the engine can take pushes, :meth:`apply_weights` does nothing
    and :meth:`poll_and_apply` returns ``False``: what TorchRL's own receiver documents, for the same reason (pushes
    arrive through collectives, not by polling)."""

    def __init__(self, scheme: VLLMWeightSyncScheme, vllm_engine: Any) -> None:
        self._scheme = scheme
        self._vllm_engine = vllm_engine

    def init_all_workers_group(self, model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None = None) -> None:
        """Check that the engine is one the sender can push to (it raises ``EngineConfigError`` naming the fix
        otherwise); the workers join when the sender's :meth:`~VLLMWeightSender.init_all_workers_group` reaches
        them, so this returns at once."""
        from lightning_vllm.engines import as_engine_targets

        try:
            as_engine_targets(self._vllm_engine)
        except TypeError as error:
            raise EngineConfigError(
                f"The receiver's engine ({type(self._vllm_engine).__name__}) cannot take lightning_vllm's pushes: "
                f"{error}"
            ) from error

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Nothing to do: each push is loaded and committed by vLLM's workers when it arrives."""

    def poll_and_apply(self, timeout: float = 0.1) -> bool:
        """``False``: pushes arrive through the group, not by polling (as TorchRL's own receiver says)."""
        return False


def get_model_metadata(model: Any) -> ModelMetadata:
    """``{name: (dtype, shape)}`` of what the sender would push for ``model`` (TorchRL's helper of the same name;
    :meth:`VLLMUpdater.get_model_metadata`): a Hugging Face or PEFT model, a LightningModule, a dict or a TensorDict."""
    return VLLMUpdater.get_model_metadata(model)


_UPDATER_KEYWORDS = (
    "vllm_tp_size", "backend", "bucket_size_bytes", "timeout_seconds", "model_attribute", "reset_prefix_cache",
    "pause_mode", "lora", "changed_only", "verify_pushes",
)  # fmt: skip
"""The updater's options the scheme passes on (its own arguments are TorchRL's)."""
