"""The receiver: vLLM's worker-side weight-transfer engine loading into a Hugging Face model, in a process of its own.

vLLM's model runner cannot run on the GPU host, so this process stands in for one vLLM worker:
it builds a randomly initialised Hugging Face model of the served shape on its device (it never
sees the trainer's weights except through the transfer) and drives vLLM's own worker engine
(``NCCLWeightTransferEngine`` or ``IPCWeightTransferEngine``) with the control calls the trainer
sends over a ``multiprocessing`` pipe. The engines are built without a ``VllmConfig``: the
base class reads only ``parallel_config`` and ``model_config`` from it; their receive paths
(``update_weights`` -> ``receive_weights``, with packed broadcasts or CUDA IPC) run unchanged.

Protocol: requests ``(id, method, args, kwargs)``; replies ``(id, ok, result)``, where a failed
request's result is ``(pickled exception or None, summary, traceback)``. Reply id 0 is the
start-up message: the facts of the model (or why it could not be built). Each request is
answered on a thread of its own, so a version query is answered while ``update_weights``
waits inside NCCL for the trainer's broadcast.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from hf_models import build_model, load_weights, loaded_metadata, model_digests, tensor_from_bytes, tensor_to_bytes
from nccl_floor import receive_broadcasts
from transformers import PretrainedConfig

BACKENDS = ("nccl", "ipc", "gloo", "pipe")
"""``nccl`` and ``ipc``: vLLM's engines (the GPU host). ``gloo``: lightning_vllm's own worker engine,
for dry runs of ``runs.py --cpu``. ``pipe``: the tensors travel in the update info (``check_cpu.py``)."""


@dataclass(frozen=True)
class ReceiverSpec:
    """What the receiver process builds.

    Attributes:
        config: the Hugging Face config of the served model.
        device: where the model lives, e.g. ``"cuda:1"``.
        backend: one of :data:`BACKENDS`.
        seed: the seed of the receiver's own random init (never the trainer's).
        stall_update_seconds: sleep this long in ``update_weights`` before receiving (failure tests).
    """

    config: PretrainedConfig
    device: str
    backend: str
    seed: int = 1000
    stall_update_seconds: float = 0.0


class PipeEngine:
    """Test transport: the update info carries the tensors themselves, as bytes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def parse_init_info(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return init_info

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.model.load_weights([(name, tensor_from_bytes(packed)) for name, packed in update_info["tensors"]])

    def finish_weight_update(self) -> None: ...

    def shutdown(self) -> None: ...


def make_engine(backend: str, model: torch.nn.Module, device: torch.device) -> Any:
    """The worker-side engine of ``backend`` for ``model`` (which has ``load_weights``), built without a VllmConfig."""
    if backend == "pipe":
        return PipeEngine(model)
    # All the base class reads from a VllmConfig: this worker is rank 0 of one, data-parallel index 0.
    parallel = SimpleNamespace(rank=0, world_size=1, data_parallel_index=0)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
    return _engine_class(backend)(SimpleNamespace(backend=backend), vllm_config, device, model)


def import_receive_path() -> str | None:
    """Import at start-up the module vLLM's receive paths import mid-transfer; returns the workaround used, if any.

    ``receive_weights`` imports ``vllm.model_executor.model_loader.mtp_validation`` (one context
    variable), whose package ``__init__`` imports every model loader. Should that fail (a torch
    older than vLLM wants), the packages are registered without running their ``__init__`` and
    the module itself, plain Python, is imported.
    """
    module = "vllm.model_executor.model_loader.mtp_validation"
    try:
        importlib.import_module(module)
        return None
    except Exception as error:  # noqa: BLE001  # reported in the facts
        reason = f"{type(error).__name__}: {error}"
    import vllm

    for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        if name not in sys.modules:  # a package whose __init__ failed is not left there
            package = ModuleType(name)
            package.__path__ = [os.path.join(os.path.dirname(vllm.__file__), *name.split(".")[1:])]
            sys.modules[name] = package
    importlib.import_module(module)
    return f"imported {module} without its packages' __init__ ({reason})"


def _engine_class(backend: str) -> type:
    # vLLM's start/finish run its layerwise reload, which only vLLM's model classes support;
    # a Hugging Face model loads in place in load_weights, so they keep only what is not reload.
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        class HFNCCLEngine(NCCLWeightTransferEngine):
            def start_weight_update(self) -> None: ...

            def finish_weight_update(self) -> None: ...

        return HFNCCLEngine
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        class HFIPCEngine(IPCWeightTransferEngine):
            def start_weight_update(self) -> None: ...

            def finish_weight_update(self) -> None:
                self._packed_importer.close()  # as vLLM's does after its reload: the trainer may free its buffer

        return HFIPCEngine
    if backend == "gloo":
        from lightning_vllm.backends.gloo.worker import GlooWeightTransferEngine

        class HFGlooEngine(GlooWeightTransferEngine):
            def finish_weight_update(self) -> None:
                pending, self.pending = self.pending, None
                for tensors in pending.wait() if pending is not None and len(pending) else []:
                    if tensors:
                        self.model.load_weights(tensors)

        return HFGlooEngine
    raise ValueError(f"Unknown backend {backend!r}: one of {BACKENDS}")


class Receiver:
    """The model, the engine, the committed weight version, and one method per request.

    Mirrors vLLM's worker: ``update_weights`` and ``finish_weight_update`` need an open update
    (``start_weight_update``); a failed ``update_weights`` closes it; ``finish_weight_update``
    commits the version when one is given, and the version is ``"default"`` before any.
    """

    REQUESTS = (
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
        "shutdown_weight_transfer_engine", "get_weight_version", "checksum", "state", "stats", "raw_broadcast",
    )  # fmt: skip

    def __init__(self, spec: ReceiverSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = build_model(spec.config, self.device, spec.seed).eval().requires_grad_(False)
        self.model.load_weights = self._load_weights  # what vLLM's engines call; counted for stats()
        self.import_workaround = import_receive_path() if spec.backend in ("nccl", "ipc") else None
        self.engine = make_engine(spec.backend, self.model, self.device)
        self.version = "default"
        self.updating = False
        self.loaded_bytes = 0

    def facts(self) -> dict[str, Any]:
        """What the trainer's adapter reports about the model: what it loads, and whether it ties embeddings."""
        return {
            "weights": loaded_metadata(self.model),
            "ties_word_embeddings": bool(getattr(self.spec.config, "tie_word_embeddings", False)),
            "pid": os.getpid(),
            "import_workaround": self.import_workaround,
        }

    def _load_weights(self, weights: Any) -> None:
        self.loaded_bytes += load_weights(self.model, weights)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()
        self.updating, self.loaded_bytes = True, 0

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if not self.updating:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        time.sleep(self.spec.stall_update_seconds)
        try:
            self.engine.update_weights(update_info[0] if isinstance(update_info, list) else update_info)
        except BaseException:
            self.updating = False
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.updating:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.updating = False
        self.engine.finish_weight_update()
        if weight_version is not None:
            self.version = weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        self.updating = False
        self.engine.shutdown()

    def get_weight_version(self) -> str:
        return self.version

    def checksum(self) -> dict[str, Any]:
        """Per-tensor digests, computed on the receiver's device (see ``hf_models.digest``)."""
        return model_digests(self.model)

    def state(self) -> dict[str, Any]:
        """Every tensor as bytes (small models only)."""
        return {name: tensor_to_bytes(param) for name, param in self.model.named_parameters()}

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "loaded_bytes_last_update": self.loaded_bytes, "updating": self.updating}

    def raw_broadcast(self, master_address: str, master_port: int, num_bytes: int, rounds: int) -> list[float]:
        """Receive ``rounds`` broadcasts of ``num_bytes`` from rank 0 over vLLM's bare ``PyNcclCommunicator``.

        The floor our pushes are compared with: the same two processes, the same bytes, no packing,
        no loading. Returns the seconds of each round as seen here (``nccl_floor.receive_broadcasts``).
        """
        return receive_broadcasts(master_address, master_port, num_bytes, rounds, self.device)


def error_payload(error: BaseException) -> tuple[bytes | None, str, str]:
    """A failed request's reply: the exception pickled when it can be, its summary, its traceback."""
    try:
        pickled: bytes | None = pickle.dumps(error)
    except Exception:  # noqa: BLE001  # e.g. an exception holding a lock or a CUDA handle
        pickled = None
    summary = f"{type(error).__name__}: {error}"
    return pickled, summary, "".join(traceback.format_exception(type(error), error, error.__traceback__))


def serve(conn: Connection, spec: ReceiverSpec) -> None:
    """The receiver process: build, report the facts, then answer requests until ``close`` or the pipe ends."""
    lock = threading.Lock()

    def reply(request_id: int, ok: bool, result: Any) -> None:
        with lock:  # replies come from many threads; a Connection is not thread-safe
            try:
                conn.send((request_id, ok, result))
            except (OSError, ValueError):  # the trainer is gone
                pass
            except Exception as error:  # noqa: BLE001  # an unpicklable result
                conn.send((request_id, False, error_payload(error)))

    try:
        receiver = Receiver(spec)
    except BaseException as error:
        reply(0, False, error_payload(error))
        os._exit(1)
    reply(0, True, receiver.facts())
    while True:
        try:
            request_id, method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # the trainer is gone
        if method == "close":
            reply(request_id, True, None)
            break
        handler = getattr(receiver, method) if method in Receiver.REQUESTS else None
        thread = threading.Thread(
            target=_answer, args=(handler, method, receiver.device, reply, request_id, args, kwargs), daemon=True
        )
        thread.start()
    # Not a normal exit: a thread may be blocked in NCCL for good, and interpreter shutdown would wait on it.
    os._exit(0)


def _answer(
    handler: Callable[..., Any] | None,
    method: str,
    device: torch.device,
    reply: Callable[[int, bool, Any], None],
    request_id: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    try:
        if handler is None:
            raise AttributeError(f"The receiver has no request {method!r}; it answers {', '.join(Receiver.REQUESTS)}")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread; vLLM's engines read it
        result = handler(*args, **kwargs)
    except BaseException as error:
        reply(request_id, False, error_payload(error))
        return
    reply(request_id, True, result)
