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
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_vllm.weights.layer_sums import (
    LayerSums,
    add_sums,
    layer_of,
    sums_as_ints,
    sums_of_many,
    tensor_sums,
)
from lightning_vllm.weights.packed_sums import any_packed, loaded_as, packed_from

NOT_PACKED_HERE = (
    "packed for oneDNN by a load lightning_vllm did not fingerprint (vLLM's CPU build): the engine's start, or a push "
    "with verify_pushes=False; checked from the next checked push that sends it"
)
STALE_PACK = "computes with a packed copy of other values than it holds (its pack was not rebuilt after the load)"


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
        name: (parameter, _fused_experts(module, parameter))
        for name, module, parameter in _parameters_with_modules(model)
    }


def _fused_experts(module: torch.nn.Module, parameter: torch.Tensor) -> int:
    """How many routed experts ``parameter`` holds as rows (vLLM's fused MoE ``w13_weight``, ``w2_weight``), else 0."""
    experts = getattr(module, "global_num_experts", None)
    return experts if isinstance(experts, int) and parameter.dim() >= 2 and parameter.shape[0] == experts else 0


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
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    entries: list[tuple[str, str, torch.Tensor]] = []  # (kind, layer, values)
    taken: list[tuple[str, str, torch.Tensor]] = []  # (kind, layer, sums of the values as written)
    packed: list[tuple[str, str, torch.Tensor]] = []  # (kind, layer, fingerprint taken as vLLM packed it)
    unverifiable: dict[str, str] = {}
    for name, module, parameter in _parameters_with_modules(model):
        layer = layer_of(name)
        if isinstance(module, AttentionLayerBase):
            continue  # (an attention layer loads no weight: MLA's W_UV and W_UK_T are computed from kv_b_proj, checked)
        kind = "sharded" if getattr(module, "tp_size", 1) > 1 or _moe_tp_size(module) > 1 else "replicated"
        if parameter.numel() == 0 and (fingerprint := packed_from(module)) is not None:
            packed.append((kind, layer, fingerprint))
            continue
        if parameter.numel() == 0:
            unverifiable[layer] = NOT_PACKED_HERE
        elif not parameter.dtype.is_floating_point or parameter.dtype.itemsize == 1:
            unverifiable[layer] = f"stored as {parameter.dtype} (quantized)"
        elif getattr(module, "num_kv_head_replicas", 1) > 1:
            unverifiable[layer] = "its key/value heads are copied to several tensor-parallel ranks"
        if layer in unverifiable:
            continue
        experts = _fused_experts(module, parameter)
        if experts and getattr(module, "use_ep", False):
            unverifiable[layer] = "its experts are spread over expert-parallel ranks"
            continue
        rows = [(f"{layer}.{index}", row) for index, row in enumerate(parameter)] if experts else [(layer, parameter)]
        sums = (written or {}).get(name)
        if sums is None and (as_loaded := loaded_as(module, parameter)) is not None:
            sums = [as_loaded]  # (fingerprinted as the last load left it, and computed with as it is: packed_sums.py)
        if sums is not None and len(sums) == len(rows):
            taken.extend((kind, row_layer, row_sums) for (row_layer, _), row_sums in zip(rows, sums))
        else:
            entries.extend((kind, row_layer, values) for row_layer, values in rows)
    live = [values for _, _, values in entries]
    live_sums = sums_of_many(live, [None] * len(live))
    report: dict[str, dict[str, Any]] = {
        "sharded": {},
        "replicated": {},
        "unverifiable": unverifiable,
        "stale": _stale_packs(model, {id(values): sums for values, sums in zip(live, live_sums)})
        if any_packed()
        else {},
    }
    kinds_layers = [(kind, layer) for kind, layer, _ in entries + packed + taken]
    all_sums = live_sums + [fingerprint for _, _, fingerprint in packed + taken]
    for (kind, layer), (bits, squares, _) in zip(kinds_layers, sums_as_ints(all_sums)):
        add_sums(report[kind], layer, [bits, squares])
    return report


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
