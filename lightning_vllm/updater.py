"""The updater: ties what is sent, how it moves and where vLLM lives, with versions.

Its interface follows TorchRL's ``torchrl.collectors.llm.vLLMUpdater``
(``master_address``, ``master_port``, ``model_metadata``, ``vllm_tp_size``;
``init``, ``push_weights``, ``get_model_metadata``, ...), so code written for
TorchRL finds the names it knows.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightSource

from lightning_vllm._waits import TimedClient, call_with_timeout
from lightning_vllm.engines import EngineTarget, PauseMode, as_engine_targets
from lightning_vllm.errors import EngineConfigError, WeightsMismatchError
from lightning_vllm.transports import resolve_backend, trainer_init_info
from lightning_vllm.transports.buckets import DEFAULT_BUCKET_SIZE_BYTES
from lightning_vllm.transports.gloo import DEFAULT_TIMEOUT_SECONDS, validate_bucket_size
from lightning_vllm.transports.plugin import register_backends
from lightning_vllm.weights import (
    ModelMetadata,
    PushSource,
    check_weights,
    source_metadata,
    weights_from,
)
from lightning_vllm.weights.checks import INPUT_EMBEDDING_SUFFIX, TIED_OUTPUT_EMBEDDING
from lightning_vllm.weights.sources import differs_from_input_embedding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    """Figures of one successful push."""

    weight_version: int
    seconds: float
    num_bytes: int


class VLLMUpdater:
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
        master_port: port for the rendezvous; ``None`` picks a free one.
        model_metadata: ``{name: (dtype, shape)}`` of the weights to send, dtypes being
            the engine's serving dtypes; taken from the first pushed model when ``None``.
        vllm_tp_size: vLLM's tensor-parallel size; checked against the engine when given.
        engine: the vLLM engine(s) to update: a ``vllm.LLM``, an ``AsyncLLM``, a server URL
            (``"http://host:port"``), a Ray actor handle of ``VLLMActor``, any
            ``EngineTarget``, or a list mixing them (worker ids are list positions).
        backend: ``"auto"`` (NCCL between CUDA devices, gloo otherwise), ``"gloo"``,
            ``"nccl"`` or ``"ipc"``; must match the engine's ``weight_transfer_config``.
        bucket_size_bytes: largest packed bucket on the wire, which bounds the trainer's
            extra memory during a push.
        timeout_seconds: the longest any single wait (rendezvous, transfer, control call) may take.
        model_attribute: attribute of a LightningModule that holds the Hugging Face model;
            found automatically when ``None``.
        reset_prefix_cache: reset vLLM's prefix cache after each push.
        pause_mode: how engines that serve while training (``AsyncLLM``, servers) treat
            requests in flight during a push: ``"keep"`` freezes and resumes them (nothing
            lost), ``"wait"`` finishes them first, ``"abort"`` drops them.

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
    ) -> None:
        if master_port is not None and not 0 <= master_port < 65536:
            raise ValueError(f"Invalid value for master_port={master_port}. Must be in [0, 65535], or None.")
        if vllm_tp_size is not None and vllm_tp_size < 1:
            raise ValueError(f"Invalid value for vllm_tp_size={vllm_tp_size}. Must be >= 1.")
        if timeout_seconds <= 0:
            raise ValueError(f"Invalid value for timeout_seconds={timeout_seconds}. Must be > 0.")
        validate_bucket_size(bucket_size_bytes)
        resolve_backend(backend, engine_device="cpu")  # checks the name early
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"Invalid value for pause_mode={pause_mode!r}. Must be 'keep', 'wait' or 'abort'.")
        self.master_address = master_address or "127.0.0.1"
        self.master_port = master_port
        self.model_metadata: ModelMetadata | None = _as_metadata(model_metadata)
        self.vllm_tp_size = vllm_tp_size
        self.backend = backend
        self.bucket_size_bytes = bucket_size_bytes
        self.timeout_seconds = timeout_seconds
        self.model_attribute = model_attribute
        self.reset_prefix_cache = reset_prefix_cache
        self.pause_mode: PauseMode = pause_mode
        self._engines: list[EngineTarget] = as_engine_targets(engine) if engine is not None else []
        self._links: dict[int, _Link] = {}
        self._version = 0
        self._post_hooks: list[Callable[[], Any]] = []
        self._collector_ref: weakref.ref[Any] | None = None
        self.last_sync: SyncStats | None = None

    # -- construction from a policy ----------------------------------------------

    @classmethod
    def from_policy(cls, policy: Any) -> VLLMUpdater | None:
        """An updater for ``policy`` if it holds a Hugging Face model vLLM can serve, else ``None``.

        The updater carries the policy's metadata; give it an engine before the first push.
        """
        if not isinstance(policy, torch.nn.Module):
            return None
        try:
            metadata = cls.get_model_metadata(policy)
        except (TypeError, ValueError):
            return None
        return cls(model_metadata=metadata)

    @classmethod
    def get_model_metadata(cls, model: Any, model_attribute: str | None = None) -> ModelMetadata:
        """``{name: (dtype, shape)}`` of what would be sent for ``model``, read without copying a tensor.

        Args:
            model: a Hugging Face or PEFT model, a LightningModule holding one, a dict or a TensorDict.
            model_attribute: the LightningModule attribute holding the model, if not found automatically.
        """
        return source_metadata(weights_from(model, model_attribute))

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
        self.close()
        self._engines = as_engine_targets(engine) if engine is not None else []

    @property
    def initialized(self) -> bool:
        """Whether a group is formed with every engine."""
        return bool(self._engines) and len(self._links) == len(self._engines)

    def all_worker_ids(self) -> list[int]:
        """Ids of the engines this updater can push to: their positions in ``engine``."""
        return list(range(len(self._engines)))

    def engine_versions(self) -> dict[int, str | None]:
        """The weight version each engine reports, by worker id."""
        return {
            worker_id: call_with_timeout(engine.get_weight_version, timeout=self.timeout_seconds, what="the engine's version")
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
            self.model_metadata = _as_metadata(model_metadata)
        if self.model_metadata is None:
            raise ValueError(
                "init needs the model metadata: pass init(VLLMUpdater.get_model_metadata(model)) or "
                "model_metadata=... to the constructor."
            )
        if not self._engines:
            raise EngineConfigError("No vLLM engine to push to: pass engine=... (e.g. a vllm.LLM) to VLLMUpdater.")
        self.close()
        for worker_id in self.all_worker_ids():
            self._connect(worker_id, self.model_metadata)

    def _connect(self, worker_id: int, metadata: ModelMetadata) -> _Link:
        engine = self._engines[worker_id]
        backend = self._check_engine(engine)
        wire, ties = self._wire_metadata(engine, metadata)
        register_backends()
        client = TimedClient(engine, self.timeout_seconds)
        source = PushSource(wire)
        world_size = 1 + call_with_timeout(engine.num_workers, timeout=self.timeout_seconds, what="the engine's world size")
        init_info = trainer_init_info(
            backend,
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=world_size,
            bucket_size_bytes=self.bucket_size_bytes,
            timeout_seconds=self.timeout_seconds,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        log.info("Joining %s's %d worker(s) over %s", engine.description, world_size - 1, backend)
        transfer = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
        link = _Link(engine, client, transfer, source, wire, ties)
        self._links[worker_id] = link
        return link

    def _wire_metadata(self, engine: EngineTarget, metadata: ModelMetadata) -> tuple[ModelMetadata, bool]:
        """What goes on the wire: the engine's names and serving dtypes, checked against ``metadata``."""
        expected = call_with_timeout(engine.expected_weights, timeout=self.timeout_seconds, what="the engine's model facts")
        if expected is None:
            log.warning(
                "Cannot read which weights %s loads (no local safetensors checkpoint); sending the metadata as given "
                "without checking it against the engine.",
                engine.description,
            )
            return dict(metadata), False
        offered = _offered(metadata, expected.ties_word_embeddings)
        check_weights(expected.weights, offered, what="The model metadata")
        return {name: expected.weights[name] for name in offered}, expected.ties_word_embeddings

    def _check_engine(self, engine: EngineTarget) -> str:
        configured = call_with_timeout(engine.transfer_backend, timeout=self.timeout_seconds, what=f"{engine.description} to describe itself")
        backend = resolve_backend(self.backend, engine_device=engine.device_type())
        if configured is None:
            raise EngineConfigError(
                f"The {engine.description} engine was built without a weight-transfer config, so it cannot receive "
                f"weights. Build it with weight_transfer_config={{'backend': '{backend}'}}."
            )
        if configured != backend:
            raise EngineConfigError(
                f"The {engine.description} engine expects weight-transfer backend {configured!r} but this updater "
                f"uses {backend!r}. Build the engine with weight_transfer_config={{'backend': '{backend}'}} or pass "
                f"backend={configured!r} to the updater."
            )
        if self.vllm_tp_size is not None and self.vllm_tp_size != engine.tensor_parallel_size():
            raise EngineConfigError(
                f"vllm_tp_size={self.vllm_tp_size} but the engine runs with tensor_parallel_size="
                f"{engine.tensor_parallel_size()}; pass vllm_tp_size={engine.tensor_parallel_size()} or leave it None."
            )
        return backend

    def close(self) -> None:
        """Leave every group and release the engines' side of them; the engines keep serving."""
        for worker_id in list(self._links):
            self._disconnect(worker_id)

    def _disconnect(self, worker_id: int) -> None:
        link = self._links.pop(worker_id, None)
        if link is None:
            return
        link.transfer.shutdown()
        try:
            link.client.shutdown_weight_transfer_engine()
        except Exception as error:  # the engine may be gone; nothing left to release then
            log.warning("Could not release the weight-transfer engine of %s: %s", link.engine.description, error)

    # -- versions, hooks and the collector ------------------------------------------

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

    # -- pushing ----------------------------------------------------------------

    def __call__(self, weights: Any = None, worker_ids: Any = None) -> SyncStats:
        """Same as :meth:`push_weights` (TorchRL's updaters are callable)."""
        return self.push_weights(weights, worker_ids)

    def push_weights(
        self,
        policy_or_weights: Any = None,
        worker_ids: int | torch.device | Sequence[int | torch.device] | None = None,
    ) -> SyncStats:
        """Send weights to vLLM and commit them as a new version.

        Joins the groups first if :meth:`init` has not run (metadata then comes from
        the weights). An engine whose push fails is disconnected and joined again at
        the next push, so an engine that restarted is picked up.

        Args:
            policy_or_weights: a Hugging Face or PEFT model, a LightningModule holding one,
                a dict of tensors or a TensorDict (nested keys joined with ``"."``).
            worker_ids: engines to update, by id (see :meth:`all_worker_ids`) or by device
                (the engines on that device type); all when ``None``.

        Returns:
            The version pushed, the seconds it took and the bytes sent.

        Raises:
            WeightsMismatchError: the weights do not fit an engine's model; nothing is sent.
            WeightSyncError: a transfer failed (that engine keeps its previous version).
        """
        weights = policy_or_weights if policy_or_weights is not None else self._get_server_weights()
        source = self._maybe_map_weights(weights)
        targets = self._resolve_worker_ids(worker_ids)
        offered = source_metadata(source)
        if self.model_metadata is None:
            self.model_metadata = offered
        links = [self._links.get(worker_id) or self._connect(worker_id, self.model_metadata) for worker_id in targets]
        for link in links:  # every check before the first byte moves
            check_weights(link.wire, _offered(offered, link.ties), what="The weights pushed")
            if link.ties:
                _check_tied_output_embedding(source, offered)
        version = self._version + 1
        start = time.perf_counter()
        num_committed = 0
        try:
            for worker_id in targets:  # each commits self._version + 1
                self._sync_weights_with_worker(worker_id=worker_id, server_weights=source)
                num_committed += 1
        finally:
            if num_committed:  # the version is used once any engine has committed it
                self._version = version
        self.last_sync = SyncStats(version, time.perf_counter() - start, sum(_num_bytes(link.wire) for link in links))
        for hook in self._post_hooks:
            hook()
        return self.last_sync

    def _get_server_weights(self) -> Any:
        """Not used, as in TorchRL's vLLMUpdater: weights must be passed to :meth:`push_weights`."""
        raise ValueError(
            "push_weights needs the weights: pass the policy (a Hugging Face model or a LightningModule holding one), "
            "a dict of tensors or a TensorDict. This updater does not fetch weights by itself."
        )

    def _maybe_map_weights(self, server_weights: Any) -> WeightSource:
        """Turn a model, a dict or a TensorDict into the named, streamed source the transport reads."""
        return weights_from(server_weights, self.model_attribute)

    def _sync_weights_with_worker(self, *, worker_id: int | torch.device | None = None, server_weights: Any = None) -> None:
        """Send ``server_weights`` to one engine (``None``: the first) and commit the next version there.

        Generation on that engine is paused (``pause_mode``) for the transfer and resumed after it.
        """
        if server_weights is None:
            server_weights = self._get_server_weights()
        worker_id = 0 if worker_id is None else worker_id
        if not isinstance(worker_id, int) or worker_id not in self._links:
            raise RuntimeError(f"The updater is not connected to engine {worker_id!r}: call init() first.")
        link = self._links[worker_id]
        source = server_weights if isinstance(server_weights, WeightSource) else self._maybe_map_weights(server_weights)
        engine = link.engine
        link.source.current = source
        link.client.next_weight_version = str(self._version + 1)
        self._bounded(engine.pause_generation, self.pause_mode, what=f"{engine.description} to pause generation")
        try:
            link.transfer.send_weights()
            if self.reset_prefix_cache:
                self._bounded(engine.reset_prefix_cache, what=f"{engine.description} to reset its prefix cache")
        except BaseException:
            self._disconnect(worker_id)
            raise
        finally:
            link.source.current = None
            self._bounded(engine.resume_generation, what=f"{engine.description} to resume generation")

    def _bounded(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return call_with_timeout(fn, *args, timeout=self.timeout_seconds, what=what)

    def _resolve_worker_ids(self, worker_ids: int | torch.device | Sequence[int | torch.device] | None) -> list[int]:
        known = self.all_worker_ids()
        if not known:
            raise EngineConfigError("No vLLM engine to push to: pass engine=... (e.g. a vllm.LLM) to VLLMUpdater.")
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


@dataclass
class _Link:
    """One engine's connection: its client, the transfer engine and what goes on its wire."""

    engine: EngineTarget
    client: TimedClient
    transfer: TrainerWeightTransferEngine[Any]
    source: PushSource
    wire: ModelMetadata
    ties: bool


def _offered(metadata: ModelMetadata, ties_word_embeddings: bool) -> ModelMetadata:
    # A model that ties its output embedding to its input embedding loads only the
    # input one; a state dict still lists both, and the tied copy is not sent.
    if ties_word_embeddings:
        return {name: meta for name, meta in metadata.items() if name != TIED_OUTPUT_EMBEDDING}
    return metadata


def _check_tied_output_embedding(source: WeightSource, offered: ModelMetadata) -> None:
    if TIED_OUTPUT_EMBEDDING not in offered:
        return
    embedding = differs_from_input_embedding(source, TIED_OUTPUT_EMBEDDING, INPUT_EMBEDDING_SUFFIX)
    if embedding is not None:
        raise WeightsMismatchError(
            f"The weights pushed do not fit the engine's model; nothing was sent and vLLM keeps its weights: "
            f"{TIED_OUTPUT_EMBEDDING!r} differs from {embedding!r}, but the engine's model ties its output "
            "embedding to its input embedding. Start the engine from a checkpoint saved from this model "
            "(tie_word_embeddings must agree)."
        )


def _num_bytes(metadata: ModelMetadata) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in metadata.values())


def _as_metadata(metadata: Mapping[str, tuple[torch.dtype, Any]] | None) -> ModelMetadata | None:
    if metadata is None:
        return None
    return {name: (dtype, torch.Size(shape)) for name, (dtype, shape) in metadata.items()}


vLLMUpdater = VLLMUpdater
"""TorchRL's spelling of the same class."""
