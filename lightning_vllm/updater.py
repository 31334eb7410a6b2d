"""The updater: ties what is sent, how it moves and where vLLM lives, with versions.

Its interface follows TorchRL's ``torchrl.collectors.llm.vLLMUpdater``
(``master_address``, ``master_port``, ``model_metadata``, ``vllm_tp_size``;
``init``, ``push_weights``, ``get_model_metadata``, ...), so code written for
TorchRL finds the names it knows.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightSource

from lightning_vllm._waits import call_with_timeout
from lightning_vllm.connection import ConnectionSettings, EngineConnection
from lightning_vllm.engines import EngineTarget, as_engine_targets
from lightning_vllm.engines.base import ServesLoraAdapters
from lightning_vllm.errors import EngineConfigError, PartialPushError, WeightsMismatchError, WeightSyncError
from lightning_vllm.lora.adapter import adapter_source, choose_view, lora_policy
from lightning_vllm.options import LoraMode, PauseMode, UpdaterOptions, check_updater_options
from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, DEFAULT_TIMEOUT_SECONDS
from lightning_vllm.torchrl_interface import TorchRLInterface, register_with_torchrl
from lightning_vllm.versions import WeightVersions
from lightning_vllm.weights import ModelMetadata, source_metadata, weights_from
from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import as_metadata
from lightning_vllm.weights.payload import Payload, PushView


@dataclass(frozen=True)
class SyncStats:
    """Figures of one push that landed in at least one engine.

    Attributes:
        weight_version: the version committed.
        seconds: how long the push took, every engine included.
        num_bytes: the bytes sent, every engine included.
        worker_ids: the engines that committed it.
        failed_worker_ids: the engines it failed on (they keep their previous weights; see
            :class:`~lightning_vllm.errors.PartialPushError`).
    """

    weight_version: int
    seconds: float
    num_bytes: int
    worker_ids: tuple[int, ...] = ()
    failed_worker_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PreparedPush:
    """A checked push not sent yet: what it carries, the engines it goes to (by worker id),
    and the engines it cannot reach (their errors, by worker id)."""

    payload: Payload
    worker_ids: list[int]
    unreachable: dict[int, BaseException] = field(default_factory=dict)


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
        self._engines: list[EngineTarget] = as_engine_targets(engine) if engine is not None else []
        check_updater_options(
            UpdaterOptions(
                master_address=master_address,
                master_port=master_port,
                vllm_tp_size=vllm_tp_size,
                backend=backend,
                bucket_size_bytes=bucket_size_bytes,
                timeout_seconds=timeout_seconds,
                model_attribute=model_attribute,
                pause_mode=pause_mode,
                lora=lora,
                changed_only=changed_only,
            ),
            num_engines=len(self._engines),
        )
        self.master_address = master_address or "127.0.0.1"
        self.master_port = master_port
        self.model_metadata: ModelMetadata | None = as_metadata(model_metadata)
        self.vllm_tp_size = vllm_tp_size
        self.backend = backend
        self.bucket_size_bytes = bucket_size_bytes
        self.timeout_seconds = timeout_seconds
        self.model_attribute = model_attribute
        self.reset_prefix_cache = reset_prefix_cache
        self.pause_mode: PauseMode = pause_mode
        self.lora: LoraMode = lora
        self.changed_only = changed_only
        self._connections: dict[int, EngineConnection] = {}
        self.versions = WeightVersions()
        self._post_hooks: list[Callable[[], Any]] = []
        self._collector_ref: weakref.ref[Any] | None = None
        self.last_sync: SyncStats | None = None
        register_with_torchrl(type(self))  # TorchRL's collectors then take it (docs/torchrl.md)

    # -- engines and groups -----------------------------------------------------

    @property
    def engine(self) -> EngineTarget | None:
        """The adapter of the first engine (the only one, usually)."""
        return self._engines[0] if self._engines else None

    @property
    def engines(self) -> list[EngineTarget]:
        """The adapters of every engine, in worker-id order."""
        return list(self._engines)

    def set_engine(self, engine: Any) -> None:
        """Replace the engine(s) this updater pushes to (leaving any group formed with the old ones)."""
        engines = as_engine_targets(engine) if engine is not None else []
        check_updater_options(self.options(), num_engines=len(engines))
        self.close()
        self._engines = engines

    def options(self) -> UpdaterOptions:
        """The settings this updater pushes with (its public attributes of the same names)."""
        return UpdaterOptions(**{field.name: getattr(self, field.name) for field in fields(UpdaterOptions)})

    @property
    def initialized(self) -> bool:
        """Whether a group is formed with every engine."""
        return bool(self._engines) and len(self._connections) == len(self._engines)

    def engine_versions(self) -> dict[int, str | None]:
        """The weight version each engine reports, by worker id."""
        return {
            worker_id: call_with_timeout(
                engine.get_weight_version, timeout=self.timeout_seconds, what="the engine's version"
            )
            for worker_id, engine in enumerate(self._engines)
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
        for worker_id in self.all_worker_ids():
            self._connect(worker_id)

    def _connect(self, worker_id: int) -> EngineConnection:
        assert self.model_metadata is not None, "set by init or by the first push"
        # Read at each connection: the settings are public attributes a user may change.
        settings = ConnectionSettings(**{field.name: getattr(self, field.name) for field in fields(ConnectionSettings)})
        if settings.master_port:  # a fixed port: one per engine, each group has its own rendezvous
            settings = replace(settings, master_port=settings.master_port + worker_id)
        connection = EngineConnection.open(self._engines[worker_id], self.model_metadata, settings)
        self._connections[worker_id] = connection
        # An earlier trainer (or run) may have pushed further: a version never names two sets of weights.
        self.versions.follow(connection.reported_version)
        return connection

    def _connect_each(self, worker_ids: Sequence[int]) -> tuple[dict[int, EngineConnection], dict[int, BaseException]]:
        """The connection of each engine, joining the groups not formed yet, and the engines that
        cannot be reached now (their errors): a push still goes to the others.

        Raises:
            EngineConfigError, WeightsMismatchError: an engine is misconfigured, which no retry fixes.
            WeightSyncError: no engine can be reached (the first one's error).
        """
        connections: dict[int, EngineConnection] = {}
        unreachable: dict[int, BaseException] = {}
        for worker_id in worker_ids:
            try:
                connections[worker_id] = self._connections.get(worker_id) or self._connect(worker_id)
            except (EngineConfigError, WeightsMismatchError):
                raise
            except WeightSyncError as error:
                unreachable[worker_id] = error
        if not connections:
            raise next(iter(unreachable.values()))
        return connections, unreachable

    def close(self) -> None:
        """Leave every group and release the engines' side of them; the engines keep serving."""
        while self._connections:
            _, connection = self._connections.popitem()
            connection.close()

    # -- pushing ----------------------------------------------------------------

    def __call__(
        self,
        policy_or_weights: Any = None,
        worker_ids: int | torch.device | Sequence[int | torch.device] | None = None,
    ) -> SyncStats:
        """Same as :meth:`push_weights`: TorchRL's collectors call their updater with these keywords."""
        return self.push_weights(policy_or_weights, worker_ids)

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
        if isinstance(weights, Payload):  # chosen already (a push every trainer rank takes part in)
            payload = weights
        else:
            payload = self.payload_for(weights, self.lora_view(weights, targets))
        offered = source_metadata(payload.weights)
        if self.model_metadata is None:  # (an adapter view set it from the merged weights)
            self.model_metadata = offered
        connections, unreachable = self._connect_each(targets)
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
        failures: dict[int, BaseException] = dict(push.unreachable)
        num_bytes = 0
        try:
            for worker_id in push.worker_ids:
                try:
                    self._sync_weights_with_worker(worker_id=worker_id, server_weights=push.payload, version=version)
                except Exception as error:  # noqa: BLE001  # the other engines still get the push
                    failures[worker_id] = error
                    continue
                num_bytes += self._connections[worker_id].last_num_bytes
                committed.append(worker_id)
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
            named = "; ".join(
                f"engine {worker_id} ({self._engines[worker_id].description}): {type(error).__name__}: {error}"
                for worker_id, error in sorted(failures.items())
            )
            raise PartialPushError(
                f"Weight version {version} reached engine(s) {committed} but failed on {named}. Those engines keep "
                "their previous weights, and their rollouts say so; the next push joins them again.",
                stats,
                failures,
            ) from next(iter(failures.values()))
        return stats

    # -- LoRA policies ------------------------------------------------------------

    def may_send_adapter(self, weights: Any) -> bool:
        """Whether a push of ``weights`` may send a LoRA adapter alone (then :meth:`lora_view` decides)."""
        return self.lora != "merged" and lora_policy(weights, self.model_attribute) is not None

    def lora_view(self, weights: Any, worker_ids: Sequence[int] | None = None) -> PushView:
        """How a push of ``weights`` is sent: ``"merged"`` (full weights, as given), ``"adapter"``
        (the LoRA adapter alone) or ``"base_and_adapter"`` (an engine lacks the policy's base weights);
        connects to the engines if needed.

        Raises:
            EngineConfigError: ``lora="adapter"`` but an engine cannot serve the adapter (says why).
            ValueError: ``lora="adapter"`` but ``weights`` is not a PEFT LoRA policy sent from a
                plain, DDP or FSDP2 module.
        """
        if isinstance(weights, WeightSource) or self.lora == "merged":
            return "merged"  # a ready source is sent as it is
        model = lora_policy(weights, self.model_attribute, required=self.lora == "adapter")
        if model is None:
            return "merged"
        if self.model_metadata is None:
            self.model_metadata = source_metadata(self._maybe_map_weights(weights))
        targets = self._resolve_worker_ids(None) if worker_ids is None else worker_ids
        connections = list(self._connect_each(targets)[0].values())  # (the engines not reached get nothing)
        problems = [f"{c.engine.description}: {problem}" for c in connections for problem in c.adapter_problems(model)]
        problems += self._collector_lora_problems()
        return choose_view(self.lora, problems, all(connection.has_policy_base for connection in connections))

    def payload_for(self, weights: Any, view: PushView) -> Payload:
        """What a push of ``weights`` carries for ``view`` (see :meth:`lora_view`): the one place
        where a push's tensors, its LoRA adapter and its stamps are chosen."""
        if view == "merged":
            source = self._maybe_map_weights(weights)
            return Payload(source, view, stamps=source.stamps() if self.changed_only else None)
        model = lora_policy(weights, self.model_attribute)
        assert model is not None, "lora_view chose an adapter view for a LoRA policy"
        source, config = adapter_source(model, with_base=view == "base_and_adapter")
        return Payload(source, view, adapter_config=config)

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to pass to ``llm.generate`` to sample from the policy's adapter
        (``None`` before an adapter push, and when merged weights are pushed)."""
        engine = self.engine
        return engine.lora_request() if isinstance(engine, ServesLoraAdapters) else None

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
        """Send ``server_weights`` to one engine (``None``: the first) and commit ``version`` there.

        ``version`` defaults to the next one. Generation on that engine is paused
        (``pause_mode``) for the transfer and resumed after it. A failed push leaves
        the group; the next push joins again.
        """
        if server_weights is None:
            server_weights = self._get_server_weights()
        worker_id = 0 if worker_id is None else worker_id
        if not isinstance(worker_id, int) or worker_id not in self._connections:
            raise RuntimeError(f"The updater is not connected to engine {worker_id!r}: call init() first.")
        payload = server_weights if isinstance(server_weights, Payload) else self.payload_for(server_weights, "merged")
        try:
            self._connections[worker_id].push(payload, self.versions.committed + 1 if version is None else version)
        except BaseException:
            del self._connections[worker_id]  # the failed push closed it
            raise


vLLMUpdater = VLLMUpdater
"""TorchRL's spelling of the same class."""
