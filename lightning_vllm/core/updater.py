"""The updater: ties what is sent, how it moves and where vLLM lives, with versions.

Its interface follows TorchRL's ``torchrl.collectors.llm.vLLMUpdater``
(``master_address``, ``master_port``, ``model_metadata``, ``vllm_tp_size``;
``init``, ``push_weights``, ``get_model_metadata``, ...), so code written for
TorchRL finds the names it knows.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightSource

from lightning_vllm._waits import call_with_timeout
from lightning_vllm.core.connection import EngineConnection
from lightning_vllm.core.engine_set import EngineSet, PreparedPush, SyncStats, WorkerIds
from lightning_vllm.core.payloads import choose_payload
from lightning_vllm.core.versions import WeightVersions
from lightning_vllm.engines import EngineTarget, as_engine_targets
from lightning_vllm.engines.base import ServesLoraAdapters
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.options import ConnectionSettings, LoraMode, PauseMode, UpdaterOptions, check_updater_options
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_TIMEOUT_SECONDS
from lightning_vllm.torchrl_interface import TorchRLInterface, register_with_torchrl
from lightning_vllm.weights import ModelMetadata, source_metadata, weights_from
from lightning_vllm.weights.model import as_metadata
from lightning_vllm.weights.payload import Payload, PushView


class VLLMUpdater(TorchRLInterface):
    """Pushes a policy's weights into a vLLM engine over vLLM's weight-transfer protocol.

    For each engine the updater joins one collective group with its workers (trainer
    rank 0, then every worker; one group per engine, so engines fail and are updated
    independently), checks before any byte moves that the engine is set up
    for the chosen backend and that the weights fit the engine's model (names,
    shapes, dtypes, read from the checkpoint the engine loaded), converts them to
    the engine's serving dtype on the way, and after each successful push commits a new weight
    version in the engine and resets its prefix cache, so no rollout reuses KV
    computed with old weights.

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
            ``"nccl"`` or ``"ipc"``; must match the engine's ``weight_transfer_config``.
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
    ) -> None:
        self._engine_set = EngineSet(as_engine_targets(engine) if engine is not None else [], self._connect)
        self.master_address = master_address or "127.0.0.1"
        self.master_port = master_port
        self.vllm_tp_size = vllm_tp_size
        self.backend = backend
        self.bucket_size_bytes = bucket_size_bytes
        self.timeout_seconds = timeout_seconds
        self.model_attribute = model_attribute
        self.pause_mode: PauseMode = pause_mode
        self.lora: LoraMode = lora
        self.changed_only = changed_only
        check_updater_options(self.options(), num_engines=len(self._engine_set))  # before anything is used
        self.model_metadata: ModelMetadata | None = as_metadata(model_metadata)
        self.reset_prefix_cache = reset_prefix_cache
        self.versions = WeightVersions()
        self._post_hooks: list[Callable[[], Any]] = []
        self._collector_ref: weakref.ref[Any] | None = None
        self.last_sync: SyncStats | None = None
        register_with_torchrl(type(self))  # TorchRL's collectors then take it (docs/torchrl.md)

    # -- engines and groups -----------------------------------------------------

    @property
    def engine(self) -> EngineTarget | None:
        """The target of the first engine (the only one, usually)."""
        return self._engine_set.targets[0] if self._engine_set.targets else None

    @property
    def engines(self) -> list[EngineTarget]:
        """The targets of every engine, in index (worker id) order."""
        return list(self._engine_set.targets)

    def set_engine(self, engine: Any) -> None:
        """Replace the engine(s) this updater pushes to (leaving any group formed with the old ones)."""
        targets = as_engine_targets(engine) if engine is not None else []
        check_updater_options(self.options(), num_engines=len(targets))
        self.close()
        self._engine_set = EngineSet(targets, self._connect)

    def options(self) -> UpdaterOptions:
        """The settings this updater pushes with (its public attributes of the same names)."""
        return UpdaterOptions(
            master_address=self.master_address,
            master_port=self.master_port,
            vllm_tp_size=self.vllm_tp_size,
            backend=self.backend,
            bucket_size_bytes=self.bucket_size_bytes,
            timeout_seconds=self.timeout_seconds,
            model_attribute=self.model_attribute,
            pause_mode=self.pause_mode,
            lora=self.lora,
            changed_only=self.changed_only,
        )

    @property
    def initialized(self) -> bool:
        """Whether a group is formed with every engine."""
        return bool(self._engine_set) and len(self._engine_set.connections) == len(self._engine_set)

    def all_worker_ids(self) -> list[int]:
        """Ids of the engines this updater can push to: their positions in ``engine`` (TorchRL's name)."""
        return self._engine_set.indices()

    def engine_versions(self) -> dict[int, str | None]:
        """The weight version each engine reports, by worker id."""
        return {
            index: call_with_timeout(
                engine.get_weight_version, timeout=self.timeout_seconds, what="the engine's version"
            )
            for index, engine in enumerate(self._engine_set.targets)
        }

    def init(self, model_metadata: Mapping[str, tuple[torch.dtype, Any]] | None = None) -> None:
        """Check the metadata against each engine's model and join a group with each engine's workers.

        Blocks until every worker has joined, at most ``timeout_seconds`` per engine.

        Args:
            model_metadata: ``{name: (dtype, shape)}`` of the weights to send; replaces the
                constructor's value when given.

        Raises:
            EngineConfigError: no engine, an engine without a weight-transfer config, a
                different backend, or a tensor-parallel size that does not match.
            WeightsMismatchError: the metadata does not fit an engine's model.
            WeightSyncTimeoutError: the workers did not join in time.
        """
        if model_metadata is not None:
            self.model_metadata = as_metadata(model_metadata)
        if self.model_metadata is None:
            raise ValueError(
                "init needs the model metadata: pass init(VLLMUpdater.get_model_metadata(model)) or "
                "model_metadata=... to the constructor."
            )
        self._require_engines()
        self.close()
        for index in self._engine_set.indices():
            self._engine_set.open(index)

    def _require_engines(self) -> None:
        if not self._engine_set.targets:
            self._engine_set = EngineSet(self._engines_of_collector(), self._connect)
        if not self._engine_set.targets:
            raise EngineConfigError("No vLLM engine to push to: pass engine=... (e.g. a vllm.LLM) to VLLMUpdater.")

    def _resolve_worker_ids(self, worker_ids: WorkerIds) -> list[int]:
        self._require_engines()
        return self._engine_set.resolve(worker_ids)

    def _connect(self, index: int) -> EngineConnection:
        assert self.model_metadata is not None, "set by init or by the first push"
        settings = ConnectionSettings.for_engine(self.options(), index, self.reset_prefix_cache)
        connection = EngineConnection.open(self._engine_set.targets[index], self.model_metadata, settings)
        # An earlier trainer (or run) may have pushed further: a version never names two sets of weights.
        self.versions.follow(connection.reported_version)
        return connection

    def close(self) -> None:
        """Leave every group and release the engines' side of them; the engines keep serving."""
        self._engine_set.close()

    # -- versions and hooks ------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version of the weights last pushed (0 before the first push); see ``versions``."""
        return self.versions.committed

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self.versions.set_committed(value)

    def register_post_hook(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` after every push that commits a version, in registration order; never after one
        that no engine took."""
        if not callable(hook):
            raise TypeError(f"A post hook must be callable, got {type(hook).__name__}.")
        self._post_hooks.append(hook)

    @property
    def post_hooks(self) -> list[Callable[[], Any]]:
        """The hooks run after each push that commits a version."""
        return list(self._post_hooks)

    # -- pushing ----------------------------------------------------------------

    def push_weights(
        self,
        policy_or_weights: Any = None,
        worker_ids: int | torch.device | Sequence[int | torch.device] | None = None,
    ) -> SyncStats:
        """Send weights to vLLM and commit them as a new version.

        Joins the groups first if :meth:`init` has not run (metadata then comes from
        the weights). Every engine is tried; an engine whose push fails is disconnected and
        joined again at the next push, so an engine that restarted is picked up. The version
        is committed once any engine has it (see :meth:`send_prepared`).

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
        try:
            push = self.prepare_push(policy_or_weights, worker_ids)
        except BaseException:
            self.versions.skip()  # these weights reach no engine
            raise
        return self.send_prepared(push, self.versions.begin())

    def prepare_push(
        self,
        policy_or_weights: Any = None,
        worker_ids: int | torch.device | Sequence[int | torch.device] | None = None,
    ) -> PreparedPush:
        """Everything of :meth:`push_weights` before the first byte moves: what to send, to which
        engines (joining their groups if needed), and every check. :meth:`send_prepared` sends it.

        Raises:
            WeightsMismatchError, EngineConfigError: as :meth:`push_weights`; nothing was sent.
        """
        weights = policy_or_weights if policy_or_weights is not None else self._get_server_weights()
        targets = self._resolve_worker_ids(worker_ids)
        payload = self.choose_payload(weights, targets)
        offered = source_metadata(payload.weights)
        if self.model_metadata is None:  # (an adapter view set it from the merged weights)
            self.model_metadata = offered
        connections, unreachable = self._engine_set.connected(targets)
        for connection in connections.values():  # every check before the first byte moves
            connection.check(payload, offered)
        return PreparedPush(payload, list(connections), unreachable)

    def send_prepared(self, push: PreparedPush, version: int) -> SyncStats:
        """Send a push made by :meth:`prepare_push` (whose payload's weights may since have been
        replaced by a copy with the same metadata) and commit it as ``version`` (from ``versions.begin()``).

        Every engine is tried, whatever happened to the others. The version is committed as soon
        as one engine has it (a version never names two sets of weights); an engine that fails
        keeps its previous weights and joins again at the next push. Post hooks run once the
        version is committed.

        Raises:
            PartialPushError: some engines took the push and some did not (its ``stats`` and
                ``failures`` say which).
            WeightSyncError: no engine took it; the error of the first engine that failed (the
                version is not committed).
        """
        start = time.perf_counter()
        committed: list[int] = []
        try:
            committed, failures, num_bytes = self._engine_set.push_each(push, version)
        finally:
            if committed:
                self.versions.commit(version)
            else:
                self.versions.abandon(version)
        if not committed:
            raise next(iter(failures.values()))
        stats = SyncStats(version, time.perf_counter() - start, num_bytes, tuple(committed), tuple(sorted(failures)))
        self.last_sync = stats
        for hook in self._post_hooks:
            hook()
        if failures:
            raise self._engine_set.partial_push_error(stats, failures)
        return stats

    # -- what a push carries ------------------------------------------------------

    def choose_payload(
        self,
        weights: Any,
        worker_ids: Sequence[int] | None = None,
        agree: Callable[[Callable[[], PushView]], PushView] | None = None,
    ) -> Payload:
        """What a push of ``weights`` carries (see ``lightning_vllm.core.payloads``): its tensors, its LoRA
        adapter and its stamps, chosen once; asking whether the engines can serve an adapter connects
        to them. ``agree`` lets the trainer's ranks decide together.

        Raises:
            EngineConfigError: ``lora="adapter"`` but an engine cannot serve the adapter (says why).
            ValueError: ``lora="adapter"`` but ``weights`` is not a PEFT LoRA policy sent from a
                plain, DDP or FSDP2 module.
        """
        if isinstance(weights, Payload):  # chosen already (a push every trainer rank takes part in)
            return weights
        if self.model_metadata is None and not isinstance(weights, WeightSource):  # (to connect, if asked)
            self.model_metadata = source_metadata(weights_from(weights, self.model_attribute))
        serving = functools.partial(self._engine_set.serving, worker_ids, self._collector_lora_problems())
        return choose_payload(weights, self.options(), serving, agree)

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to pass to ``llm.generate`` to sample from the policy's adapter
        (``None`` before an adapter push, and when merged weights are pushed)."""
        engine = self.engine
        return engine.lora_request() if isinstance(engine, ServesLoraAdapters) else None


vLLMUpdater = VLLMUpdater
"""TorchRL's spelling of the same class."""
