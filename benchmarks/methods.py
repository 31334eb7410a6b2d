"""The four ways to get a trainer's weights into a running vLLM engine, timed side by side.

* ``ours``: ``VLLMUpdater.push_weights`` without the check after the push (``verify_pushes=False``), end to end
  (checks before any byte moves, gloo buckets, load,
  prefix-cache reset, version), every tensor written since the last push (as in full
  fine-tuning: the version counter of every parameter is bumped before each run, outside
  the timing, so changed-only pushes send everything).
* ``checked``: ours with the check after every push (``verify_pushes``, the product's default): it over
  ours is what the check costs.
* ``frozen_embed``: the same, in a fine-tune with frozen embeddings: every parameter but
  the input embedding is written before each run, so the push leaves the embedding's
  layer group out (changed-only pushes; the engine keeps it).
* ``disk``: what many users do today: ``save_pretrained`` into a folder, then vLLM's
  ``reload_weights(weights_path=...)``.
* ``per_tensor``: the design of TorchRL's first updater and classic TRL: one control
  call and one broadcast per tensor (same gloo transport and worker as ours).
* ``streaming``: ours, but each worker loads what has landed while the rest is still
  coming, as it did before updates became atomic: ours over it is what atomicity costs.
* ``floor``: the same bytes through the same transport with nothing else to do (the
  worker only receives), then vLLM's in-memory ``reload_weights`` of the received
  tensors (see ``floor_worker.py``): what a sync costs if moving and loading the
  bytes were its only work, done one after the other.

The engine's worker holds one gloo group at a time, so each method (re)connects
before it runs when another one used the engine last; connecting is not timed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_vllm import VLLMUpdater
from lightning_vllm.backends.gloo.messages import GlooTrainerInitInfo, TensorSpec
from lightning_vllm.backends.gloo.trainer import GlooTrainerWeightTransferEngine, send_order
from lightning_vllm.engines import as_engine_target
from lightning_vllm.weights import weights_from

TIMEOUT_SECONDS = 600.0
METHODS = ("ours", "checked", "frozen_embed", "disk", "per_tensor", "streaming", "floor")
FROZEN = "embed_tokens."  # the parameters a frozen-embeddings fine-tune leaves alone


class SyncMethods:
    """Every method against one engine and one model; call :meth:`run` with a method's name.

    Args:
        llm: a ``vllm.LLM`` built with the gloo backend and ``FloorWorkerExtension``.
        model: the trainer's Hugging Face model (its weights are what each method sends).
        workdir: where the ``disk`` method saves the model.
        bucket_size_bytes: the bucket size of ours (and of the floor's plan).
    """

    def __init__(self, llm: Any, model: torch.nn.Module, workdir: Path, bucket_size_bytes: int) -> None:
        self.llm = llm
        self.model = model
        self.workdir = workdir
        self.bucket_size_bytes = bucket_size_bytes
        self.updater = VLLMUpdater(
            engine=llm, bucket_size_bytes=bucket_size_bytes, timeout_seconds=TIMEOUT_SECONDS, verify_pushes=False
        )
        self.checked = VLLMUpdater(engine=llm, bucket_size_bytes=bucket_size_bytes, timeout_seconds=TIMEOUT_SECONDS)
        self._raw: GlooTrainerWeightTransferEngine | None = None
        self._raw_method: str | None = None
        self._connected: VLLMUpdater | None = None
        self.floor_client = FloorClient(llm)
        self.bytes_sent: dict[str, int] = {}  # per method of ours, the bytes of its last push
        self.checked_layers: list[tuple[int, int]] = []  # per checked push: layers compared, of the layers sent
        self.streaming_client = StreamingClient(llm)

    def run(self, method: str) -> float:
        """Run ``method`` once; returns its wall-clock seconds.

        A method that had to connect first (another one used the engine last) runs
        once untimed before the timed run: a trainer pushes many times over one
        connection, and the first push after connecting also touches fresh memory.
        """
        action: Callable[[], None]
        written = lambda: None  # noqa: E731  # what the training step before this push wrote
        if method in ("ours", "checked", "frozen_embed"):
            connected = self._connect(self.checked if method == "checked" else self.updater)
            frozen = FROZEN if method == "frozen_embed" else None
            written = lambda: self.write_all_but(frozen)  # noqa: E731
            action = lambda: self._push_and_count(method)  # noqa: E731
        elif method == "disk":
            connected = False
            action = self.disk
        elif method in ("per_tensor", "floor", "streaming"):
            connected, raw = self._connect_raw(method)
            action = lambda: self.per_tensor(raw) if method == "per_tensor" else raw.send_weights()  # noqa: E731
        else:
            raise ValueError(f"Unknown method {method!r}; expected one of {METHODS}.")
        if connected:
            written()
            action()
        written()
        start = time.perf_counter()
        action()
        return time.perf_counter() - start

    def write_all_but(self, frozen: str | None) -> None:
        """Count every parameter (but those whose name contains ``frozen``) as written, as a training
        step does, without touching its data: only the version counter moves."""
        params = [p for name, p in self.model.named_parameters() if frozen is None or frozen not in name]
        torch.autograd.graph.increment_version(params)

    def _push_and_count(self, method: str) -> None:
        updater = self.checked if method == "checked" else self.updater
        stats = updater.push_weights(self.model)
        self.bytes_sent[method] = stats.num_bytes
        if method == "checked":
            self.checked_layers.append(stats.checked_layers)

    # -- connecting (not timed) -------------------------------------------------------
    # The engine's worker has one weight-transfer engine, so one group at a time.

    def _connect(self, updater: VLLMUpdater) -> bool:
        """Connect ``updater``; returns whether it had to."""
        if self._connected is updater:
            return False
        self._disconnect()
        updater.init(VLLMUpdater.get_model_metadata(self.model))
        self._connected = updater
        return True

    def _connect_raw(self, method: str) -> tuple[bool, GlooTrainerWeightTransferEngine]:
        """The bare trainer engine of the per-tensor, streaming or floor method, and whether it had to connect.

        The floor's and streaming's engines talk to the worker through their own clients and
        replay the model's weights.
        """
        if self._raw is not None and self._raw_method == method:
            return False, self._raw
        self._disconnect()
        clients = {"floor": self.floor_client, "streaming": self.streaming_client}
        self._raw = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(
                world_size=2, bucket_size_bytes=self.bucket_size_bytes, timeout_seconds=TIMEOUT_SECONDS
            ),
            client=clients.get(method) or as_engine_target(self.llm),
            source=weights_from(self.model) if method in clients else None,
        )
        self._raw_method = method
        return True, self._raw

    def _disconnect(self) -> None:
        if self._raw is not None:
            self._raw.shutdown()
            self._raw.client.shutdown_weight_transfer_engine()
            self._raw = self._raw_method = None
        if self._connected is not None:
            self._connected.close()
            self._connected = None

    def close(self) -> None:
        self._disconnect()

    # -- the methods --------------------------------------------------------------------

    def disk(self) -> None:
        folder = self.workdir / "disk"
        self.model.save_pretrained(folder, safe_serialization=True)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def per_tensor(self, raw: GlooTrainerWeightTransferEngine) -> None:
        raw.client.start_weight_update()
        for group, tensors in self._layer_groups():
            for spec, tensor in zip(group, tensors):
                raw.send_update([[spec]], iter([tensor]))
        raw.client.finish_weight_update()
        self.llm.reset_prefix_cache()

    def _layer_groups(self) -> list[tuple[list[TensorSpec], list[torch.Tensor]]]:
        """Specs and tensors per layer group, in the order ours sends them."""
        source = weights_from(self.model)
        return [(specs, list(batch)) for specs, (_, batch) in zip(send_order(source), source.iter_groups())]


def peak_extra_rss_bytes(fn: Callable[[], Any]) -> int:
    """This process's resident-memory high-water mark during ``fn`` minus its resident memory before.

    Linux only: writing 5 to ``/proc/self/clear_refs`` resets the high-water mark.
    """
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line; the memory figures need Linux.")
    return int(match.group(1))


class FloorClient:
    """The weight-sync client of the floor: its update only receives, then reloads the received
    tensors with vLLM's ``reload_weights`` (``floor_worker.py``), which runs its own layer-wise
    reload, so starting and finishing an update do nothing."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.parts: list[dict[str, float]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        as_engine_target(self.llm).init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.parts.append(self.llm.collective_rpc("benchmark_floor_receive", args=(update_info,))[0])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def shutdown_weight_transfer_engine(self) -> None:
        as_engine_target(self.llm).shutdown_weight_transfer_engine()


class StreamingClient(FloorClient):
    """The weight-sync client of ``streaming``: its update loads each segment as it lands
    (``floor_worker.py``), under its own layer-wise reload."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("benchmark_streaming_receive", args=(update_info,))
