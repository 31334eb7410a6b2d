"""Weight sources: what a push reads, as vLLM ``WeightSource`` objects.

A source declares its ``metadata`` (names, dtypes, shapes, read without copying or
gathering any tensor) and yields ``(name, tensor)`` pairs one at a time when the
transport asks, so a push never holds a second copy of the model. Every source is a
:class:`~lightning_vllm.weights.base.Weights`, which vLLM 0.32's and 0.33's trainer
engines both read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

from lightning_vllm.weights.base import ForeignWeights, Stamp, Weights, stamps_of
from lightning_vllm.weights.checkpoint_layout import in_checkpoint_layout
from lightning_vllm.weights.fp8 import FP8, SCALE_SUFFIX, block_fp8, scale_shape
from lightning_vllm.weights.fsdp import FSDPWeights
from lightning_vllm.weights.layer_sums import SentSums
from lightning_vllm.weights.lora_merge import lora_parameters, merge_inputs, merged_lora_weights
from lightning_vllm.weights.model import ModelMetadata, canonical_name, find_hf_model, repeated_names
from lightning_vllm.weights.survey import Survey, survey
from lightning_vllm.weights.zero3 import ZeRO3Weights


def _check_unique(names: list[str], origin: str) -> None:
    repeated = repeated_names(names)
    if repeated:
        raise ValueError(
            f"{origin} gives several tensors the same checkpoint name after removing wrapper prefixes: "
            f"{', '.join(repeated[:5])}. Pass the Hugging Face model itself."
        )


class _ParameterWeights(Weights):
    """The parameters of a module under their checkpoint names; subclasses say which and how read."""

    def __init__(self, module: torch.nn.Module, names: list[str] | None = None) -> None:
        self.module = module
        # Found once: a source serves one push, and walking an 8B model's modules costs milliseconds each time.
        self._found = list(self._parameters())
        if names is None:
            names = [canonical_name(name) for name, _ in self._found]
            _check_unique(names, type(module).__name__)
        self._names = names  # (given: found, and checked, by an earlier source of the same parameters)

    def _parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name as in the module, parameter)`` of every tensor sent, in send order."""
        return iter(self.module.named_parameters())

    def _tensors(self) -> Iterator[torch.Tensor]:
        """The tensors sent, in the order of :meth:`_parameters`."""
        for _, param in self._found:
            yield materialize_full_tensor(param.detach())

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, parameter)`` of every tensor sent, in send order; nothing is read or gathered."""
        return zip(self._names, (param for _, param in self._found))

    def held_tensors(self) -> tuple[list[str], list[torch.Tensor]] | None:
        """The parameters, when none is a shard (nothing gathered); a subclass that sends tensors computed from them
        says ``None`` (:class:`LoraMergedWeights`)."""
        params = [param for _, param in self._found]
        if any(isinstance(param, DTensor) for param in params):
            return None
        return self._names, params

    def declare(self) -> list[ParamMeta]:
        # A DTensor (FSDP2) reports its global shape here, so nothing is gathered.
        return [ParamMeta(name, param.dtype, tuple(param.shape)) for name, (_, param) in zip(self._names, self._found)]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return zip(self._names, self._tensors())

    def stamps(self) -> dict[str, Stamp] | None:
        """What each sent tensor is computed from, as stamps (``weights/base.py``)."""
        return stamps_of(
            [(name, self._inputs(module_name, param)) for name, (module_name, param) in zip(self._names, self._found)]
        )

    def _inputs(self, name: str, param: torch.Tensor) -> list[torch.Tensor]:
        """The tensors the one sent for parameter ``name`` is computed from."""
        return [param]


class ModuleWeights(_ParameterWeights):
    """The parameters of a Hugging Face model, under their checkpoint names.

    Dense parameters are yielded as they are (no copy); FSDP shards are gathered
    with ``full_tensor()`` one parameter at a time.

    Args:
        module: the model.
        parameters: its ``named_parameters()``, when a walk found them already (``survey.Survey``).
        declared: their metadata, when known already (a push's choice kept for the next: ``payload.KeptChoice``).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        parameters: list[tuple[str, torch.nn.Parameter]] | None = None,
        declared: list[ParamMeta] | None = None,
    ) -> None:
        self._given = parameters
        self._declared = declared
        super().__init__(module, names=None if declared is None else [meta.name for meta in declared])

    def _parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._given) if self._given is not None else iter(self.module.named_parameters())

    def declare(self) -> list[ParamMeta]:
        return self._declared if self._declared is not None else super().declare()


class LoraMergedWeights(_ParameterWeights):
    """A PEFT LoRA model's merged weights under the base model's names; the module is left untouched."""

    def _parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return lora_parameters(self.module)

    def _tensors(self) -> Iterator[torch.Tensor]:
        return (tensor for _, tensor in merged_lora_weights(self.module))

    def held_tensors(self) -> None:
        """``None``: the merged tensors are computed for each push, not held."""
        return None

    def _inputs(self, name: str, param: torch.Tensor) -> list[torch.Tensor]:
        return [param, *merge_inputs(self.module, name)]


class LoraBaseWeights(_ParameterWeights):
    """A PEFT LoRA model's base weights under the base model's names, without the adapters' delta."""

    def _parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return lora_parameters(self.module)


class MappingWeights(Weights):
    """Weights given as a dict or a TensorDict (nested keys joined with ``"."``)."""

    def __init__(self, weights: Mapping[str, Any] | Any) -> None:
        flat = _flatten(weights)
        names = [canonical_name(name) for name in flat]
        _check_unique(names, "The weights")
        self._tensors = dict(zip(names, flat.values()))

    def declare(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self._tensors.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._tensors.items():
            yield name, materialize_full_tensor(tensor.detach())

    def stamps(self) -> dict[str, Stamp] | None:
        """Each tensor's stamp (``weights/base.py``)."""
        return stamps_of([(name, [tensor]) for name, tensor in self._tensors.items()])


def _flatten(weights: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    from tensordict import TensorDictBase

    if isinstance(weights, TensorDictBase):
        weights = weights.flatten_keys(".").to_dict()
    flat: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, Mapping) or hasattr(value, "flatten_keys"):
            flat.update(_flatten(value, prefix=f"{name}."))
        else:
            raise TypeError(f"Weight {name!r} is a {type(value).__name__}, not a tensor.")
    return flat


def weights_from(
    policy_or_weights: Any, model_attribute: str | None = None, surveys: Callable[[torch.nn.Module], Survey] = survey
) -> Weights:
    """The source for what ``push_weights`` was given.

    Args:
        policy_or_weights: a Hugging Face model, a PEFT model, a LightningModule holding
            one, a ``dict`` of tensors, a TensorDict, or a ready vLLM ``WeightSource`` (of vLLM
            0.32's API or 0.33's).
        model_attribute: the LightningModule attribute holding the model, if not found automatically.
        surveys: how a module is surveyed (a push's :class:`~lightning_vllm.weights.survey.Surveys` walks each
            module once for all its questions).

    Raises:
        TypeError: for anything else.
    """
    if isinstance(policy_or_weights, Weights):
        return policy_or_weights
    if isinstance(policy_or_weights, WeightSource):
        return ForeignWeights(policy_or_weights)
    if isinstance(policy_or_weights, torch.nn.Module):
        # Each in the layout of the model's checkpoint, which vLLM loads (a MoE model's experts one by one).
        if surveys(policy_or_weights).fsdp_units:  # FSDP1: names and shapes from its flat parameters
            return in_checkpoint_layout(FSDPWeights(policy_or_weights, model_attribute), policy_or_weights)
        model = find_hf_model(policy_or_weights, model_attribute)
        found = surveys(model)
        if found.zero3_parameters:  # ZeRO-3: full shapes from the placeholders
            return in_checkpoint_layout(ZeRO3Weights(model), model)
        source = LoraMergedWeights(model) if found.lora_layers else ModuleWeights(model, found.parameters)
        return in_checkpoint_layout(source, model)
    if isinstance(policy_or_weights, Mapping) or hasattr(policy_or_weights, "flatten_keys"):
        return MappingWeights(policy_or_weights)
    raise TypeError(
        f"Cannot push weights from a {type(policy_or_weights).__name__}: pass a Hugging Face model, a LightningModule "
        "holding one, a dict of tensors or a TensorDict."
    )


def differs_from_input_embedding(source: Weights, output_name: str, input_suffix: str) -> str | None:
    """The input embedding's name if ``source``'s output embedding is not a copy of it, else ``None``.

    Stops reading the source as soon as both tensors were seen.
    """
    found: dict[str, torch.Tensor] = {}
    input_name = output_name
    for name, tensor in source:
        if name == output_name or name.endswith(input_suffix):
            found[name] = tensor
            input_name = name if name != output_name else input_name
        if len(found) == 2:
            break
    output, embedding = found.get(output_name), found.get(input_name)
    if output is None or embedding is None or output is embedding or torch.equal(output, embedding):
        return None
    return input_name


def source_metadata(source: Weights) -> ModelMetadata:
    """``{name: (dtype, shape)}`` of a source, in its order."""
    return {meta.name: (meta.dtype, torch.Size(meta.shape)) for meta in source.metadata}


class DeclaredWeights(Weights):
    """Weights known by their names, dtypes and shapes only: what a connection will send, before any push.

    vLLM's NCCL and IPC trainer engines take their source when the group forms, and
    vLLM 0.33's check it then (full tensors, one sender); each push hands the engine
    the weights it sends. Reading tensors from this one is a bug, and says so.

    Args:
        declared: ``{name: (dtype, shape)}``.
    """

    def __init__(self, declared: Mapping[str, tuple[torch.dtype, Any]]) -> None:
        self.declared = dict(declared)

    def declare(self) -> list[ParamMeta]:
        return [ParamMeta(name, dtype, tuple(shape)) for name, (dtype, shape) in self.declared.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise RuntimeError("DeclaredWeights holds no tensors: a push hands the transfer engine the weights it sends.")


class EngineWeights(Weights):
    """A source as one engine gets it: under the engine's names and serving dtypes only.

    Tensors the engine does not load (the output embedding of a model that ties it
    to the input embedding) are left out; the others are declared in the engine's
    serving dtype. Our ``gloo`` transport converts to it on the way; vLLM's own
    engines (``nccl``, ``ipc``) send the bytes they are given, so for them the tensors
    are converted here, onto ``device``.

    Args:
        source: the weights of one push.
        engine_metadata: ``{name: (dtype, shape)}`` the engine loads, fixed when connecting.
        device: where vLLM's engine sends from (the trainer's GPU); ``None`` when the
            transport converts by itself.
        sums: what tallies each ``(name, tensor, serving dtype, held)`` as it goes (the check after the push); or,
            by :meth:`tally_held`, all at once with ``held`` true.
    """

    def __init__(
        self,
        source: Weights,
        engine_metadata: Mapping[str, tuple[torch.dtype, Any]],
        device: torch.device | None = None,
        sums: SentSums | None = None,
    ) -> None:
        self.source = source
        self.engine_metadata = engine_metadata
        self.engine_dtypes = {name: dtype for name, (dtype, _) in engine_metadata.items()}
        # Weights an FP8 engine holds block-wise, quantized here, each followed by its scales (weights/fp8.py).
        self.scales = {
            name: name + SCALE_SUFFIX
            for name, dtype in self.engine_dtypes.items()
            if dtype == FP8 and name + SCALE_SUFFIX in self.engine_dtypes
        }
        self.device = device
        self.sums = sums

    def declare(self) -> list[ParamMeta]:
        declared = []
        for meta in self.source.metadata:
            if meta.name in self.engine_dtypes:
                declared.append(ParamMeta(meta.name, self.engine_dtypes[meta.name], meta.shape))
            if meta.name in self.scales:
                declared.append(ParamMeta(self.scales[meta.name], torch.float32, scale_shape(meta.shape)))
        return declared

    def groups(self) -> list[list[str]]:
        # The source's own grouping (a base-then-adapter source keeps the two apart), minus what is not sent; a
        # quantized weight's scales go right after it.
        kept = (
            [sent for name in group if name in self.engine_dtypes for sent in (name, self.scales.get(name)) if sent]
            for group in self.source.groups()
        )
        return [group for group in kept if group]

    def tally_held(self) -> bool:
        """Tally every tensor the source holds in :attr:`sums`, at once, as held (summed once the push committed:
        ``SentSums``), and none as it goes; whether the source holds them. From then on :meth:`held_tensors` names
        them, so a transport that keeps what it sent (``lightning_ipc``) keeps it on checked pushes too."""
        held = None if self.sums is None or self.scales else self.source.held_tensors()
        if held is None or self.sums is None:
            return False
        for name, tensor in zip(*held):
            if name in self.engine_dtypes:
                self.sums.tally(name, tensor, self.engine_dtypes[name], True)
        self.sums = None
        return True

    def held_tensors(self) -> tuple[list[str], list[torch.Tensor]] | None:
        """The source's, those the engine loads, unless each tensor is tallied as it goes (:meth:`iter_full`)."""
        held = None if self.sums is not None or self.scales else self.source.held_tensors()  # (FP8: made per push)
        if held is None:
            return None
        names, tensors = held
        if all(map(self.engine_dtypes.__contains__, names)):
            return held
        kept = [(name, tensor) for name, tensor in zip(names, tensors) if name in self.engine_dtypes]
        return [name for name, _ in kept], [tensor for _, tensor in kept]

    def held_signature(self) -> tuple[Any, ...] | None:
        """The source's, with the engine's metadata that filters it (a connection's, the same object at every push)."""
        held = None if self.sums is not None or self.scales else self.source.held_signature()
        return None if held is None else (self.engine_metadata, held)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source.iter_full():
            if name not in self.engine_dtypes:
                continue
            dtype = self.engine_dtypes[name]
            if name in self.scales:  # quantized on the device it is sent from, in the dtype it was trained in
                tensor = tensor if self.device is None else tensor.to(device=self.device, non_blocking=True)
                for sent_name, sent in zip((name, self.scales[name]), block_fp8(tensor)):
                    if self.sums is not None:
                        self.sums.tally(sent_name, sent, sent.dtype, False)
                    yield sent_name, sent
                continue
            # (Asked first: a no-op ``to`` still costs microseconds, and an 8B model has hundreds of tensors.)
            if self.device is not None and (tensor.dtype != dtype or tensor.device != self.device):
                tensor = tensor.to(device=self.device, dtype=dtype, non_blocking=True)
            if self.sums is not None:
                self.sums.tally(name, tensor, dtype, False)
            yield name, tensor
