"""The engine's half of the check after every push: what one vLLM worker holds, fingerprinted per layer.

Runs inside vLLM's worker. The trainer asks each worker by the name ``in_vllm/worker_methods.py`` gives it
(:func:`worker_layer_sums`), and holds the reports, combined (``core/landing_check.HeldSums``), against what it sent.
The fingerprints are those of ``layer_sums.py``, taken from the live parameters by destination layer, so a value
written to the wrong place changes the layer it landed in. A layer vLLM's CPU build packed for oneDNN has an empty
``weight``; its fingerprint is the one taken where the loader wrote its values, as they were packed
(``packed_sums.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from lightning_vllm.weights.layer_sums import (
    SQUARES_MODULUS,
    LayerSums,
    add_sums,
    fused_experts,
    layer_key,
    layer_of,
    sums_as_ints,
    sums_of_many,
    tensor_sums,
)
from lightning_vllm.weights.online_sums import is_online_quantized, quantized_from
from lightning_vllm.weights.packed_sums import any_packed, loaded_as, packed_from

NOT_PACKED_HERE = (
    "packed for oneDNN by a load lightning_vllm did not fingerprint (vLLM's CPU build): the engine's start, or a push "
    "with verify_pushes=False; checked from the next checked push that sends it"
)
ONLINE_NOT_TAKEN = (
    "quantized by vLLM as it loaded (online FP8) without lightning_vllm's fingerprints in place (its plugin was not "
    "loaded before the model): checked once a push reloads it in an engine started with lightning_vllm installed"
)
FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
"""The FP8 dtypes: every value is exact in float32, so their fingerprints are taken as any float's."""
KV_HEADS_REPLICATED = "its key/value heads are copied to several tensor-parallel ranks"
EXPERTS_SPREAD = "its experts are spread over expert-parallel ranks"
STALE_PACK = "computes with a packed copy of other values than it holds (its pack was not rebuilt after the load)"


T = TypeVar("T")  # what a load's sums of a parameter are given as: tensors, or rows of one tensor (_HeldParts)

WrittenSums = Mapping[str, Sequence[torch.Tensor]]
"""``{parameter name: [its sums, one per routed expert of a fused expert tensor, else one]}``, taken of the values
the last load wrote as it wrote them (``[bits, squares, not finite]``, as :func:`layer_sums.tensor_sums`)."""


@runtime_checkable
class SumsWhatItWrites(Protocol):
    """A weight transfer engine whose last load fingerprinted, as it wrote them, the parameters it wrote whole
    (``backends/lightning_ipc``): those are not read again for the check."""

    def written_sums(self) -> WrittenSums | None:
        """The sums of the parameters the last load wrote whole, or ``None``."""


def worker_layer_sums(worker: Any) -> dict[str, dict[str, Any]]:
    """The worker method ``lightning_vllm_layer_sums`` (``in_vllm/worker_methods.py``): :func:`held_layer_sums` of
    the worker's model, with the sums its weight transfer engine took as it wrote (:class:`SumsWhatItWrites`)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    written = engine.written_sums() if isinstance(engine, SumsWhatItWrites) else None
    return held_layer_sums(worker.get_model(), written)


def parameter_rows(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """``{name: (parameter, rows)}`` of ``model``'s parameters: ``rows`` the routed experts a fused expert tensor holds
    (each is fingerprinted apart, as a layer ``<layer>.<expert>``), else 0."""
    return {
        name: (parameter, fused_experts(module, parameter))
        for name, module, parameter in _parameters_with_modules(model)
    }


def _moe_tp_size(module: torch.nn.Module) -> int:
    config = getattr(module, "moe_config", None)
    return int(getattr(config, "tp_size", 1) or 1)


@torch.no_grad()
def held_layer_sums(model: torch.nn.Module, written: WrittenSums | None = None) -> dict[str, dict[str, Any]]:
    """Per-layer fingerprints of what ``model`` (vLLM's, in its worker) holds, on its device (on a GPU in one
    kernel launch per dtype); one sync at the end. The parameters in ``written`` are not read: their sums were taken
    as the last load wrote them; nor are the weights vLLM's CPU build left live when the last load processed their
    layer (``packed_sums.loaded_as``).

    Returns ``{"sharded": {layer: [bits, squares]}, "replicated": {...}, "unverifiable": {layer: why},
    "stale": {layer: why}}`` (``layer_sums.tensor_sums``): a parameter of a tensor-parallel layer (``tp_size > 1``)
    is this rank's shard, the others are whole on every rank. A layer is stale when its pack was built from other
    values than its live weight holds (``packed_sums.py``). Plain lists and strings, so any of vLLM's RPC paths
    carries it.
    """
    parts = _HeldParts(model, written or {})
    live = [values for _, _, values in parts.live]
    live_sums = sums_of_many(live, [None] * len(live))
    report: dict[str, dict[str, Any]] = {
        "sharded": {},
        "replicated": {},
        "unverifiable": parts.unverifiable,
        "stale": _stale_packs(model, {id(values): sums for values, sums in zip(live, live_sums)})
        if any_packed()
        else {},
    }
    kinds_layers = [(kind, layer) for kind, layer, _ in parts.live + parts.packed + parts.taken]
    all_sums = live_sums + [fingerprint for _, _, fingerprint in parts.packed + parts.taken]
    for (kind, layer), (bits, squares, _) in zip(kinds_layers, sums_as_ints(all_sums)):
        add_sums(report[kind], layer, [bits, squares])
    return report


class _HeldParts(Generic[T]):
    """``model``'s parameters, sorted for the report (:func:`held_layer_sums`): each ``(kind, layer, x)``, ``kind``
    ``"sharded"`` or ``"replicated"``; ``live``: ``x`` the values, to be read; ``packed``: the fingerprint vLLM's CPU
    build's last load left (``packed_sums.py``: taken as it packed them, or of the weight as that load left it);
    ``taken``: ``x`` from ``written`` (the sums the last load took as it wrote the
    parameter, one per routed expert row); ``unverifiable``: ``{layer: why}``."""

    def __init__(self, model: torch.nn.Module, written: Mapping[str, Sequence[T]]) -> None:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        self.live: list[tuple[str, str, torch.Tensor]] = []
        self.packed: list[tuple[str, str, torch.Tensor]] = []
        self.taken: list[tuple[str, str, T]] = []
        self.unverifiable: dict[str, str] = {}
        unverifiable = self.unverifiable
        online: dict[torch.nn.Module, tuple[str, str]] = {}  # {module quantized online: (kind, its name)}
        for name, module, parameter in _parameters_with_modules(model):
            layer = layer_of(name)
            if isinstance(module, AttentionLayerBase):
                continue  # (an attention layer loads no weight: MLA's W_UV and W_UK_T come from kv_b_proj, checked)
            kind = "sharded" if getattr(module, "tp_size", 1) > 1 or _moe_tp_size(module) > 1 else "replicated"
            if module in online:
                continue  # (each taken once, below)
            if is_online_quantized(module):
                online[module] = (kind, name.rsplit(".", 1)[0])
                continue
            if parameter.numel() == 0 and (fingerprint := packed_from(module)) is not None:
                self.packed.append((kind, layer, fingerprint))
                continue
            if parameter.numel() == 0:
                unverifiable[layer] = NOT_PACKED_HERE
            elif not parameter.dtype.is_floating_point or (
                parameter.dtype.itemsize == 1 and parameter.dtype not in FP8
            ):
                unverifiable[layer] = f"stored as {parameter.dtype} (quantized)"
            elif getattr(module, "num_kv_head_replicas", 1) > 1:
                unverifiable[layer] = KV_HEADS_REPLICATED
            if layer in unverifiable:
                continue
            experts = fused_experts(module, parameter)
            if experts and getattr(module, "use_ep", False):
                unverifiable[layer] = EXPERTS_SPREAD
                continue
            rows = [(f"{layer}.{index}", row) for index, row in enumerate(parameter)] if experts else []
            rows = rows or [(layer, parameter)]
            sums: Sequence[Any] | None = written.get(name)
            if sums is None and len(rows) == 1 and (as_loaded := loaded_as(module, parameter)) is not None:
                self.packed.append((kind, layer, as_loaded))  # (fingerprinted as the last load left it: packed_sums.py)
            elif sums is not None and len(sums) == len(rows):
                self.taken.extend((kind, row_layer, row_sums) for (row_layer, _), row_sums in zip(rows, sums))
            else:
                self.live.extend((kind, row_layer, values) for row_layer, values in rows)
        for module, (kind, prefix) in online.items():
            self._quantized_online(module, kind, prefix)

    def _quantized_online(self, module: torch.nn.Module, kind: str, prefix: str) -> None:
        """A layer vLLM quantizes as it loads it (``online_sums.py``): the values it last quantized from stand for
        what it holds; the e4m3 values and scales it made of them are vLLM's, not what was sent."""
        taken = quantized_from(module)
        layer = layer_of(f"{prefix}.weight")
        if taken is None:
            self.unverifiable[layer] = ONLINE_NOT_TAKEN
            return
        if getattr(module, "num_kv_head_replicas", 1) > 1:  # (as for any layer: the replicas were loaded too)
            self.unverifiable[layer] = KV_HEADS_REPLICATED
            return
        if getattr(module, "use_ep", False) and any(sums.dim() == 2 for sums in taken.values()):
            self.unverifiable[layer] = EXPERTS_SPREAD
            return
        for local, sums in taken.items():
            layer = layer_of(f"{prefix}.{local}")
            rows = [(f"{layer}.{index}", row) for index, row in enumerate(sums)] if sums.dim() == 2 else [(layer, sums)]
            self.packed.extend((kind, row_layer, row) for row_layer, row in rows)


class LayerRows:
    """One worker's fingerprints per layer as the rows of one tensor on its device: ``[layer_key(layer), bits,
    squares]`` (``layer_sums.layer_key``: the layer's name as an integer, the same in every process), made in a few
    launches and not read back. ``backends/lightning_ipc`` writes them into memory the trainer shares, before the event
    that tells the trainer a push landed: its check then needs no reply through vLLM's RPC. Built once for a load
    plan (which parameters the load writes whole, each summed as written: its rows of the load's sums); only where
    the report is nothing but these rows (:meth:`for_model`).

    Example::

        >>> rows = LayerRows.for_model(torch.nn.Sequential(torch.nn.LayerNorm(2)), written={})
        >>> rows.layers
        ['0']
        >>> key, bits, squares = rows.rows(None).tolist()[0]  # the weight's two 1.0s and the bias's two 0.0s
        >>> key == layer_key("0"), bits == 2 * 0x3F800000
        (True, True)
    """

    def __init__(self, layers: list[str], taken: list[tuple[str, int]], live: list[tuple[str, torch.Tensor]]) -> None:
        self.layers = layers
        at = {layer: position for position, layer in enumerate(layers)}
        self._keys = torch.tensor([layer_key(layer) for layer in layers], dtype=torch.int64)
        self._taken_from = torch.tensor([row for _, row in taken], dtype=torch.int64)
        self._taken_at = torch.tensor([at[layer] for layer, _ in taken], dtype=torch.int64)
        self._live = [values for _, values in live]
        self._live_at = torch.tensor([at[layer] for layer, _ in live], dtype=torch.int64)
        self._device = torch.device("cpu")  # (where the tensors above are)

    @classmethod
    def for_model(cls, model: torch.nn.Module, written: Mapping[str, Sequence[int]]) -> LayerRows | None:
        """The rows of ``model``'s layers, ``written``: ``{parameter name: its rows in the load's sums}`` (one per
        routed expert of a fused expert tensor). ``None`` where the report holds more than sums of whole layers: a
        layer that cannot be verified, one vLLM's CPU build packed, or a tensor-parallel shard."""
        parts = _HeldParts(model, written)
        if parts.packed or parts.unverifiable or any_packed():
            return None
        everything = parts.live + parts.taken
        if any(kind != "replicated" for kind, _, _ in everything):
            return None
        layers = list(dict.fromkeys(layer for _, layer, _ in everything))
        return cls(layers, [(layer, row) for _, layer, row in parts.taken], [(layer, t) for _, layer, t in parts.live])

    def rows(self, written: torch.Tensor | None) -> torch.Tensor:
        """``[[layer_key, bits, squares], ...]``, one row per layer of :attr:`layers`, on the device of ``written``
        (the load's sums, ``[rows, 3]`` as ``layer_sums.tensor_sums``) or of the live parameters; nothing syncs. The
        squares are modulo 2**32 only once read (``layer_sums.sums_as_ints``)."""
        device = written.device if written is not None else self._live[0].device if self._live else self._device
        if self._device != device:  # (moved once: later pushes reuse them)
            self._keys, self._taken_from, self._taken_at, self._live_at = (
                t.to(device) for t in (self._keys, self._taken_from, self._taken_at, self._live_at)
            )
            self._device = device
        sums = torch.zeros(len(self.layers), 2, dtype=torch.int64, device=device)
        if len(self._taken_from):
            assert written is not None, "rows of the load's sums need the load's sums"
            sums.index_add_(0, self._taken_at, written[self._taken_from, :2])
        if self._live:
            live = torch.stack(sums_of_many(self._live, [None] * len(self._live)))
            sums.index_add_(0, self._live_at, live[:, :2])
        return torch.cat([self._keys.unsqueeze(1), sums], dim=1)

    @staticmethod
    def report(rows: Sequence[Sequence[int]], layers_by_key: Mapping[int, str]) -> dict[str, dict[str, Any]]:
        """What :func:`held_layer_sums` reports, from rows read back (rows of layers not in ``layers_by_key``, which
        the reader never sent, are left out, as the check leaves out layers it did not send)."""
        held: dict[str, Any] = {}
        for key, bits, squares in rows:
            layer = layers_by_key.get(key)
            if layer is not None:
                held[layer] = [bits, squares % SQUARES_MODULUS]
        return {"sharded": {}, "replicated": held, "unverifiable": {}, "stale": {}}


def _parameters_with_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    """``model.named_parameters()``, each with the module that holds it, in one walk of the modules (a model's
    hundreds of parameters looked up by name took most of a worker's report once the sums came from the copies)."""
    seen: set[int] = set()
    found = []
    for prefix, module in model.named_modules():
        for local, parameter in module.named_parameters(prefix=prefix, recurse=False):
            if id(parameter) not in seen:  # (a parameter two modules share, such as a tied head, counted once)
                seen.add(id(parameter))
                found.append((local, module, parameter))
    return found


def _stale_packs(model: torch.nn.Module, live_sums: dict[int, torch.Tensor]) -> dict[str, str]:
    """The layers whose pack was built from other values than their live weight holds: an embedding or the output
    embedding tied to it (their weight stays live beside the pack), or a linear layer loaded and left unprocessed."""
    stale: dict[str, str] = {}
    for name, module in model.named_modules():
        fingerprint = packed_from(module)
        weight = getattr(module, "weight", None)
        if fingerprint is None or not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        held = live_sums.get(id(weight))
        held = tensor_sums(weight) if held is None else held
        (bits, squares, _), (packed_bits, packed_squares, _) = sums_as_ints([held, fingerprint])
        if not LayerSums(packed_bits, packed_squares).matches(bits, squares):
            stale[layer_of(f"{name}.weight")] = STALE_PACK
    return stale
