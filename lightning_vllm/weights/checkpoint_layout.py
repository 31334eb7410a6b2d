"""A model's weights in its checkpoint's layout, the one vLLM loads, through transformers' own conversion.

transformers 5 holds some models in another layout in memory than on disk. A Mixture-of-Experts model keeps
its experts fused over the expert index (``mlp.experts.gate_up_proj``, ``[experts, 2 * intermediate, hidden]``);
its checkpoint, and vLLM's loader, have one tensor per expert and projection (``mlp.experts.3.gate_proj.weight``).
``from_pretrained`` converts the checkpoint into memory with the model's conversion mapping
(``transformers/conversion_mapping.py``); ``save_pretrained`` converts back with its reverse
(``core_model_loading.revert_weight_conversion``). A push does what ``save_pretrained`` does, with the same
transforms, while the tensors stream:

- which in-memory tensors make which checkpoint tensors: transformers' ``rename_source_key`` over the reversed
  transforms, grouped as ``revert_weight_conversion`` groups them (by renamed key, the inputs in
  ``dot_natural_key`` order);
- the checkpoint tensors: the reversed converter's own operations, except ``Chunk``, which transformers copies
  into contiguous memory chunk by chunk and which is a view here. The reverse of a fused expert tensor
  (``Chunk``, then ``SplitModulelist``) is then views of the trainer's tensor: a push copies nothing. An output
  that is not contiguous after all (a chunk along an inner dimension that no split follows) is copied, as the
  wire needs.

What a checkpoint holds besides parameters goes too: a persistent buffer that vLLM loads, such as
DeepSeek-V3's router bias ``mlp.gate.e_score_correction_bias``, is sent right after its module's parameters.

A MoE decoder layer is sent as the parts vLLM loads as units rather than as one group: the routed experts (one
``FusedMoE`` module), the router, the shared experts, the rest. A changed-only push then leaves out frozen
experts or a frozen router while the rest of their layer trains (``weights/base.py``).

Plans are kept by :class:`CheckpointLayout`, one per model while it lives, one plan per declared metadata.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel
from vllm.distributed.weight_transfer.base import ParamMeta

from lightning_vllm.errors import WeightsMismatchError
from lightning_vllm.weights.base import ParamList, Stamp, Weights, tensor_stamp
from lightning_vllm.weights.hf_conversion import REFUSED, ReversedConversion, natural_order
from lightning_vllm.weights.layer_sums import MOE_PARTS
from lightning_vllm.weights.model import canonical_name, repeated_names

# The parts of a MoE block that vLLM loads as modules of their own (``FusedMoE`` holds every routed expert).
_MOE_PART = re.compile(rf"^(.*\.layers\.\d+\.[^.]+\.)({'|'.join(sorted(MOE_PARTS))})\.")
_MAX_PLANS = 8  # per model: its metadata changes rarely (a new head, a dtype cast)


@dataclass(frozen=True)
class _Step:
    """In-memory tensors turned into checkpoint tensors by one reversed transform.

    Attributes:
        key: the name transformers gives the group (a converter's first target, ``*`` where an expert index goes).
        inputs: the in-memory names, in transformers' order (``Concatenate`` and ``MergeModulelist`` keep it).
        patterns: the source pattern each input matched; empty for a rename.
        outputs: the checkpoint names made, in transformers' order.
        last: the input that arrives last in a push's stream, which completes the step.
    """

    key: str
    inputs: tuple[str, ...]
    patterns: tuple[str, ...]
    outputs: tuple[str, ...]
    last: str


@dataclass(frozen=True)
class _Buffer:
    """A persistent buffer the checkpoint holds: its checkpoint name, where the model holds it."""

    name: str
    module: weakref.ref[torch.nn.Module]
    leaf: str

    def tensor(self) -> torch.Tensor:
        module = self.module()
        buffer = None if module is None else module._buffers.get(self.leaf)
        if buffer is None:
            raise WeightsMismatchError(f"{self.name!r}, a buffer the checkpoint holds, is no longer in the model")
        return buffer


@dataclass(eq=False)  # (one plan per model and metadata: equal only to itself, as a signature compares it)
class LayoutPlan:
    """How one declared list of in-memory tensors becomes the checkpoint's.

    Attributes:
        metadata: the checkpoint tensors, in the order :meth:`convert` yields them.
        groups: their layer groups, in that order (a MoE layer split into the parts vLLM loads as units).
        inputs_of: the in-memory tensors each checkpoint tensor is made from.
        buffers_after: the persistent buffers sent after an in-memory tensor, by its name: each by its checkpoint
            name, its module (held weakly) and its name there, read at each push (``model.to(...)`` replaces it).
        converts: whether any name or tensor differs from memory (else the plan is the identity).
    """

    metadata: ParamList
    groups: list[list[str]]
    inputs_of: dict[str, tuple[str, ...]]
    buffers_after: dict[str, list[_Buffer]]
    converts: bool
    steps: dict[str, _Step] = field(repr=False)
    conversion: ReversedConversion = field(repr=False)
    config: Any = field(repr=False)

    def convert(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors made from in-memory ``tensors`` (in declared order), each as soon as its inputs
        have all arrived."""
        pending: dict[str, torch.Tensor] = {}
        steps, buffers_after = self.steps, self.buffers_after
        for name, tensor in tensors:
            yield from self._take(steps[name], name, tensor, pending)
            for buffer in buffers_after.get(name, ()):
                yield from self._take(steps[buffer.name], buffer.name, buffer.tensor().detach(), pending)

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, buffer as the model holds it now)`` of every buffer sent."""
        return ((buffer.name, buffer.tensor()) for buffers in self.buffers_after.values() for buffer in buffers)

    def _take(
        self, step: _Step, name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if not step.patterns:  # a rename (most tensors: to the same name)
            yield step.outputs[0], tensor
            return
        if name != step.last:  # the step waits for its other inputs
            pending[name] = tensor
            return
        inputs = [tensor if input_name == name else pending.pop(input_name) for input_name in step.inputs]
        made = self.conversion.run(step.key, step.patterns, inputs, self.config)
        for output in step.outputs:
            value = made[output]
            yield output, value if value.is_contiguous() else value.contiguous()


class CheckpointLayout:
    """The reverse of one model's transformers conversion, and its plans.

    :meth:`of` gives it, or ``None`` for a model whose memory layout is its checkpoint's.

    Example::

        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> from lightning_vllm.weights import ModuleWeights
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        ...     num_experts=2, num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=1,
        ...     num_key_value_heads=1, head_dim=32, vocab_size=16))
        >>> [name for name, _ in model.named_parameters() if "experts" in name]
        ['model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.experts.down_proj']
        >>> source = CheckpointLayout.of(model).weights(ModuleWeights(model))
        >>> [meta.name for meta in source.metadata if "experts.1." in meta.name]  # doctest: +NORMALIZE_WHITESPACE
        ['model.layers.0.mlp.experts.1.gate_proj.weight', 'model.layers.0.mlp.experts.1.up_proj.weight',
         'model.layers.0.mlp.experts.1.down_proj.weight']
    """

    _kept: weakref.WeakKeyDictionary[torch.nn.Module, CheckpointLayout | None] = weakref.WeakKeyDictionary()

    def __init__(self, model: torch.nn.Module, conversion: ReversedConversion) -> None:
        self._model = weakref.ref(model)
        self._conversion = conversion
        self._plans: dict[tuple[tuple[str, torch.dtype, tuple[int, ...]], ...], LayoutPlan] = {}

    @classmethod
    def of(cls, model: torch.nn.Module) -> CheckpointLayout | None:
        """The layout of ``model`` (a ``PreTrainedModel``), kept while it lives; ``None`` where transformers
        converts nothing.

        Raises:
            WeightsMismatchError: transformers cannot reverse the model's conversion (names the tensors).
        """
        if model not in cls._kept:
            conversion = ReversedConversion.of(model)
            cls._kept[model] = cls(model, conversion) if conversion is not None else None
        return cls._kept[model]

    def weights(self, source: Weights) -> Weights:
        """``source`` (the in-memory tensors of this layout's model) in the checkpoint's layout; ``source``
        itself where nothing changes.

        Raises:
            WeightsMismatchError: transformers' reverse conversion fails on the model's tensors (names them).
        """
        plan = self.plan(source.metadata)
        return CheckpointWeights(source, plan) if plan.converts else source

    def plan(self, declared: Sequence[ParamMeta]) -> LayoutPlan:
        """The plan of ``declared`` in-memory tensors, made once per model and metadata."""
        key = tuple((meta.name, meta.dtype, tuple(meta.shape)) for meta in declared)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = self._make_plan(declared)
        return plan

    def _make_plan(self, declared: Sequence[ParamMeta]) -> LayoutPlan:
        model = self._model()
        assert model is not None, "a layout is asked for by its model's pushes only"
        config = model.config  # type: ignore[union-attr]
        described = {meta.name: (meta.dtype, tuple(meta.shape)) for meta in declared}
        buffers_after = _buffers_after(model, list(described))
        for buffers in buffers_after.values():
            for buffer in buffers:
                tensor = buffer.tensor()
                described[buffer.name] = (tensor.dtype, tuple(tensor.shape))
        stream = [n for meta in declared for n in (meta.name, *(b.name for b in buffers_after.get(meta.name, ())))]
        position = {name: index for index, name in enumerate(stream)}

        # Grouped as revert_weight_conversion groups a state dict: names in natural order, by renamed key.
        groups: dict[str, list[tuple[str, str]]] = {}
        steps: dict[str, _Step] = {}
        for name in natural_order(stream):
            renamed, pattern = self._conversion.group_of(name)
            if pattern is None:
                steps[name] = _Step(name, (name,), (), (renamed,), name)
            else:
                groups.setdefault(renamed, []).append((name, pattern))
        made: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for key, members in groups.items():
            names = tuple(name for name, _ in members)
            last = max(names, key=position.__getitem__)
            patterns = tuple(pattern for _, pattern in members)
            on_meta = [torch.empty(described[name][1], dtype=described[name][0], device="meta") for name in names]
            try:
                outputs = self._conversion.run(key, patterns, on_meta, config)
            except Exception as error:  # (transformers' operations raise ValueError, RuntimeError, IndexError...)
                raise WeightsMismatchError(
                    f"transformers' reverse conversion of {', '.join(names)} into the checkpoint's layout failed "
                    f"({type(error).__name__}: {error}); {REFUSED}"
                ) from error
            step = _Step(key, names, patterns, tuple(outputs), last)
            made.update({output: (value.dtype, tuple(value.shape)) for output, value in outputs.items()})
            steps.update(dict.fromkeys(names, step))

        metadata: list[ParamMeta] = []
        inputs_of: dict[str, tuple[str, ...]] = {}
        for name in stream:
            step = steps[name]
            if not step.patterns:
                metadata.append(ParamMeta(step.outputs[0], *described[name]))
                inputs_of[step.outputs[0]] = (name,)
            elif name == step.last:
                metadata.extend(ParamMeta(output, *made[output]) for output in step.outputs)
                inputs_of.update(dict.fromkeys(step.outputs, step.inputs))
        _check_unique(metadata)
        converts = bool(groups) or bool(buffers_after) or any(step.outputs[0] != name for name, step in steps.items())
        params = ParamList(metadata)
        groups_of = moe_parts(params.layer_groups)
        return LayoutPlan(params, groups_of, inputs_of, buffers_after, converts, steps, self._conversion, config)


class CheckpointWeights(Weights):
    """A source's tensors in the checkpoint's layout (:class:`CheckpointLayout`), as views where transformers'
    operations allow.

    Args:
        source: the in-memory tensors of one model (its parameters, gathered or merged as that source does).
        plan: how they become the checkpoint's (``CheckpointLayout.plan``).
    """

    def __init__(self, source: Weights, plan: LayoutPlan) -> None:
        self.source = source
        self.plan = plan

    def declare(self) -> list[ParamMeta]:
        return self.plan.metadata

    def groups(self) -> list[list[str]]:
        return [list(group) for group in self.plan.groups]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.plan.convert(self.source.iter_full())

    def held_tensors(self) -> tuple[list[str], list[torch.Tensor]] | None:
        """The checkpoint's tensors as views of the tensors the source holds, when it holds them."""
        held = self.source.held_tensors()
        if held is None:
            return None
        converted = list(self.plan.convert(zip(*held)))
        return [name for name, _ in converted], [tensor for _, tensor in converted]

    def held_signature(self) -> tuple[Any, ...] | None:
        """The plan and the source's signature: the same views of the same held tensors (no view made)."""
        held = self.source.held_signature()
        return None if held is None else (self.plan, held)

    def stamps(self) -> dict[str, Stamp] | None:
        """Each checkpoint tensor stamped by what its in-memory tensors are stamped (a buffer by itself)."""
        stamps = self.source.stamps()
        if stamps is None:
            return None
        for name, buffer in self.plan.buffers():
            stamp = tensor_stamp(buffer)
            if stamp is None:
                return None
            stamps[name] = (stamp,)
        return {output: sum((stamps[name] for name in inputs), ()) for output, inputs in self.plan.inputs_of.items()}


def in_checkpoint_layout(source: Weights, model: torch.nn.Module) -> Weights:
    """``source``, the in-memory tensors of ``model`` (or of the outermost ``PreTrainedModel`` in its tree: PEFT's
    base model, the model that FSDP or a LightningModule wraps), in its checkpoint's layout
    (:class:`CheckpointLayout`); ``source`` itself for a model transformers does not convert.

    Raises:
        WeightsMismatchError: transformers cannot reverse the model's conversion.
    """
    pretrained = next((child for child in model.modules() if isinstance(child, PreTrainedModel)), None)
    layout = CheckpointLayout.of(pretrained) if pretrained is not None else None
    return layout.weights(source) if layout is not None else source


def moe_parts(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """Layer ``groups`` with each MoE decoder layer split into the parts vLLM loads as units: its routed experts,
    its router, its shared experts, and the runs of the rest, in order. A layer without routed experts stays whole
    (a dense MLP's gate and up projections are one module in vLLM).

    Example::

        >>> moe_parts([["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
        ...     "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.input_layernorm.weight"]])
        ... # doctest: +NORMALIZE_WHITESPACE
        [['model.layers.0.self_attn.q_proj.weight'], ['model.layers.0.mlp.gate.weight'],
         ['model.layers.0.mlp.experts.0.up_proj.weight'], ['model.layers.0.input_layernorm.weight']]
    """
    parts: list[list[str]] = []
    for group in groups:
        if not any((found := _MOE_PART.match(name)) and found.group(2) == "experts" for name in group):
            parts.append(list(group))
            continue
        previous: str | None = None
        for name in group:
            found = _MOE_PART.match(name)
            part = found.group(1) + found.group(2) if found else ""
            if part != previous or not parts:
                parts.append([])
            parts[-1].append(name)
            previous = part
    return parts


def _buffers_after(model: torch.nn.Module, names: list[str]) -> dict[str, list[_Buffer]]:
    """The persistent buffers of ``model`` that a checkpoint holds and ``names`` lack, each after the last of
    ``names`` in its module (else in its decoder layer, else at the end)."""
    declared = set(names)
    found: dict[str, list[_Buffer]] = {}
    for module_name, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            if buffer is None or leaf in module._non_persistent_buffers_set:
                continue
            name = canonical_name(f"{module_name}.{leaf}" if module_name else leaf)
            if name in declared:
                continue
            anchor = _anchor(name, names)
            found.setdefault(anchor, []).append(_Buffer(name, weakref.ref(module), leaf))
    return found


def _anchor(name: str, names: list[str]) -> str:
    for scope in (name.rpartition(".")[0], _layer_prefix(name)):
        if scope:
            within = [other for other in names if other.startswith(scope + ".")]
            if within:
                return within[-1]
    return names[-1]


def _layer_prefix(name: str) -> str:
    found = re.match(r"^(.*\.\d+)\.", name)
    return found.group(1) if found else ""


def _check_unique(metadata: list[ParamMeta]) -> None:
    repeated = repeated_names(meta.name for meta in metadata)
    if repeated:
        raise WeightsMismatchError(
            f"transformers' reverse conversion gives several tensors one checkpoint name ({', '.join(repeated[:5])}); "
            f"{REFUSED}"
        )
