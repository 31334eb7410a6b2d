"""The base of every weight source here, written once against vLLM 0.32's and 0.33's ``WeightSource``.

vLLM's trainer engines read a :class:`~vllm.distributed.weight_transfer.base.WeightSource`,
whose API changed between the two releases we support:

- vLLM 0.32 calls ``source.metadata()`` and iterates ``iter(source)``; the base class adds
  ``groups()`` and ``iter_groups()``.
- vLLM 0.33 reads ``source.metadata`` as an attribute and requires every subclass that
  defines it to make it a ``functools.cached_property`` (checked when the class is created,
  so a plain method fails at import). It iterates ``source.iter_full()`` (or ``iter_local()``)
  and asks ``implements_iter_full()``; ``groups`` and ``iter_groups`` are gone.

:class:`Weights` satisfies both with one code path: ``metadata`` is a cached property whose
value, a :class:`ParamList`, can also be called (returning itself), and iteration is
``iter_full`` with ``__iter__`` delegating to it. Subclasses implement :meth:`Weights.declare`
and :meth:`Weights.iter_full`; the layer groups and their batching live here, since 0.33 no
longer provides them. Sources from elsewhere (a user's own vLLM ``WeightSource``) are read
through :class:`ForeignWeights`, the one place that asks which API an object has.

What changed since the last push is told here too, without reading a byte of any tensor: every source stamps its
tensors (:meth:`Weights.stamps`). A tensor's *stamp* is the tensor itself (held weakly), its storage address and
its version counter (``Tensor._version``), which PyTorch bumps at every in-place write: an optimizer step,
``copy_``, ``load_state_dict``. A parameter nobody wrote since the last push (a frozen embedding, a parameter with
``requires_grad=False``, a layer no gradient reached) keeps its stamp, and the engine already holds it. Writes
through ``tensor.data`` bypass the counter: code that trains that way must push with ``changed_only=False``.

vLLM's layer-wise reload processes a layer once every tensor of it has arrived, and
fills a layer that received only some of its tensors with uninitialised memory; one
that received none keeps its weights. So what is left out is whole layer groups (a
decoder layer, the embeddings before them, the norm and head after them), never
single tensors.
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, layerwise_groups

from lightning_vllm.weights.fp8 import SCALE_SUFFIX


def held_view(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Where and how ``tensor`` views its memory: its address, shape, strides and dtype."""
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)  # (a torch.Size equals its tuple)


class ParamList(list[ParamMeta]):
    """A source's declared parameters; calling it returns itself.

    vLLM 0.33 reads ``source.metadata``, vLLM 0.32 calls ``source.metadata()``: a list
    that is also callable serves both.

    Example::

        >>> params = ParamList([ParamMeta("w", torch.float32, (2,))])
        >>> params() is params, [meta.name for meta in params]
        (True, ['w'])
    """

    def __call__(self) -> ParamList:
        return self

    @cached_property
    def layer_groups(self) -> list[list[str]]:
        """vLLM's ``layerwise_groups`` of the names, found once per list (a push whose choice was kept reuses
        its source's list, and parsing every name cost a tenth of a millisecond per push)."""
        return layerwise_groups([meta.name for meta in self])


class Weights(WeightSource):
    """A source of weights for vLLM's trainer engines (and ours), under vLLM 0.32 or 0.33.

    Subclasses implement :meth:`declare` (names, dtypes, full shapes, read without
    gathering) and :meth:`iter_full` (``(name, full tensor)`` in declared order, a fresh
    pass per call); they may override :meth:`groups`. ``metadata`` is declared once
    per source: build a new source for each push if the weights change shape.

    Example::

        >>> from lightning_vllm.weights import MappingWeights
        >>> source = MappingWeights({"model.layers.0.w": torch.ones(2), "lm_head.weight": torch.ones(3)})
        >>> [meta.name for meta in source.metadata], source.groups()
        (['model.layers.0.w', 'lm_head.weight'], [['model.layers.0.w'], ['lm_head.weight']])
    """

    @abstractmethod
    def declare(self) -> list[ParamMeta]:
        """Every tensor :meth:`iter_full` yields, in the same order; nothing is gathered or copied."""

    @abstractmethod
    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of every declared tensor, in declared order (gathers where sharded)."""

    @cached_property
    def metadata(self) -> ParamList:  # type: ignore[override]  # a method in vLLM 0.32's base, a property in 0.33's
        """What :meth:`declare` returns, read once (a ``ParamList`` declared is kept, with its layer groups)."""
        declared = self.declare()
        return declared if isinstance(declared, ParamList) else ParamList(declared)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.iter_full()

    def stamps(self) -> dict[str, Stamp] | None:
        """What each tensor is computed from (see the module docstring), for changed-only pushes;
        ``None`` (the default) when the source cannot tell: every tensor counts as changed."""
        return None

    def held_tensors(self) -> tuple[list[str], list[torch.Tensor]] | None:
        """The names and the tensors :meth:`iter_full` would yield, in its order, read without running it, when it
        yields tensors the source holds (a model's own parameters: nothing gathered, merged or computed), each as
        held or converted on the way (another dtype or device); ``None`` (the default) otherwise.

        A transport that keeps the handles of the tensors it sent (``backends/lightning_ipc/trainer.py``) checks them
        against these: an 8B model's ``iter_full`` costs about a millisecond of a push on a GPU host's CPU.
        """
        return None

    def held_signature(self) -> tuple[Any, ...] | None:
        """What tells the tensors :meth:`held_tensors` returns apart, found without making them where a source can:
        equal signatures, the same names and tensors (addresses, shapes, strides, dtypes); ``None`` when
        :meth:`held_tensors` is. A transport that keeps the handles of what it sent compares this instead of every
        tensor (``backends/lightning_ipc/trainer.py``): a MoE policy sends thousands of views of a few tensors.
        """
        held = self.held_tensors()
        if held is None:
            return None
        names, tensors = held
        return tuple(names), tuple(map(held_view, tensors))

    def groups(self) -> list[list[str]]:
        """The names in layer groups (vLLM's ``layerwise_groups``: one per decoder layer), in send order."""
        return [list(group) for group in self.metadata.layer_groups]  # (copies: a caller may change them)

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        """``(names, tensors)`` of one layer group at a time, in the order of :meth:`groups`.

        Raises:
            RuntimeError: the source yields its tensors in another order than it declared them.
        """
        tensors = self.iter_full()
        for group in self.groups():
            batch = []
            for expected in group:
                name, tensor = next(tensors)
                if name != expected:
                    raise RuntimeError(
                        f"{type(self).__name__} yielded {name!r} where {expected!r} was expected; a source must yield "
                        "its tensors in the order of its metadata."
                    )
                batch.append(tensor)
            yield list(group), batch


class ForeignWeights(Weights):
    """A vLLM ``WeightSource`` written by someone else, read through whichever API it has.

    A source written for vLLM 0.32 has ``metadata()`` and ``__iter__``; one written for
    0.33 has a ``metadata`` attribute and ``iter_full()``.

    Args:
        source: the source to read.
    """

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def declare(self) -> list[ParamMeta]:
        declared: Any = self.source.metadata
        return list(declared() if callable(declared) else declared)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        iter_full = getattr(self.source, "iter_full", None)
        return iter_full() if callable(iter_full) else iter(self.source)  # type: ignore[call-overload]


class TensorStamp:
    """One tensor's state between pushes: which tensor (held weakly, so a freed tensor whose
    memory and id a new one reuses never passes for it), where its data lives, and its version.

    (A class with slots, not a frozen dataclass, whose ``__init__`` costs several times more: a
    changed-only push stamps every tensor, hundreds, at every push.)
    """

    __slots__ = ("tensor", "data_ptr", "version", "shape")

    def __init__(self, tensor: weakref.ref[torch.Tensor], data_ptr: int, version: int, shape: tuple[int, ...]) -> None:
        self.tensor, self.data_ptr, self.version, self.shape = tensor, data_ptr, version, shape

    def matches(self, other: TensorStamp) -> bool:
        """Whether ``other`` stamps the same, still living tensor, not written in between."""
        alive = self.tensor()
        return (
            alive is not None
            and alive is other.tensor()
            and (self.data_ptr, self.version, self.shape) == (other.data_ptr, other.version, other.shape)
        )


Stamp = tuple[TensorStamp, ...]
"""What one sent tensor is computed from (one base weight, plus its adapters for merged LoRA)."""


def tensor_stamp(tensor: torch.Tensor) -> TensorStamp | None:
    """The stamp of ``tensor``, or ``None`` when a change cannot be told locally (a sharded DTensor,
    whose other shards live on other ranks).

    Example::

        >>> weight = torch.zeros(2)
        >>> before = tensor_stamp(weight)
        >>> _ = weight.add_(1)
        >>> before.matches(tensor_stamp(weight))
        False
    """
    if isinstance(tensor, DTensor):
        return None
    return TensorStamp(weakref.ref(tensor), tensor.data_ptr(), tensor._version, tuple(tensor.shape))


def same_stamp(first: Stamp | None, second: Stamp | None) -> bool:
    """Whether two stamps of a name say its tensor did not change."""
    if first is None or second is None or len(first) != len(second):
        return False
    for a, b in zip(first, second):  # (a loop, not all(...): this runs per tensor at every changed-only push)
        if not a.matches(b):
            return False
    return True


def stamps_of(tensors: Iterable[tuple[str, Iterable[torch.Tensor]]]) -> dict[str, Stamp] | None:
    """``{name: stamp}`` of named inputs (each name may be computed from several tensors), or
    ``None`` if any input cannot be stamped."""
    stamps: dict[str, Stamp] = {}
    for name, inputs in tensors:
        parts = tuple(map(tensor_stamp, inputs))
        if None in parts:  # (identity: a stamp equals only itself)
            return None
        stamps[name] = parts  # type: ignore[assignment]
    return stamps


def unchanged_names(groups: Iterable[list[str]], stamps: Mapping[str, Stamp], sent: Mapping[str, Stamp]) -> set[str]:
    """The names of the groups whose every tensor has the stamp it was last sent with.

    Example::

        >>> embed, q, k = torch.zeros(2), torch.zeros(2), torch.zeros(2)
        >>> tensors = [("embed", [embed]), ("q", [q]), ("k", [k])]
        >>> sent = stamps_of(tensors)
        >>> _ = k.add_(1)  # q and k are one group (one layer): both are sent again
        >>> sorted(unchanged_names([["embed"], ["q", "k"]], stamps_of(tensors), sent))
        ['embed']
    """
    return {
        name
        for group in groups
        if all(same_stamp(_stamp_of(sent, member), _stamp_of(stamps, member)) for member in group)
        for name in group
    }


def _stamp_of(stamps: Mapping[str, Stamp], name: str) -> Stamp | None:
    """``name``'s stamp; the block scales of an FP8 weight (``X.weight_scale_inv``, ``weights/fp8.py``) are made from
    ``X.weight`` with it, and take its stamp."""
    stamp = stamps.get(name)
    return stamp if stamp is not None or not name.endswith(SCALE_SUFFIX) else stamps.get(name[: -len(SCALE_SUFFIX)])


class SentStamps:
    """What one engine holds, as the stamps of the tensors this trainer last sent it.

    Empty until a push with stamps lands; forgotten by a push without them (an
    adapter push, a sharded policy), which leaves the engine's weights unknown.
    """

    def __init__(self) -> None:
        self.stamps: dict[str, Stamp] = {}

    def unchanged(self, groups: list[list[str]], stamps: Mapping[str, Stamp] | None) -> set[str]:
        """Names of ``groups`` that need not be sent: every tensor of their group is as last sent."""
        if stamps is None or not self.stamps:
            return set()
        return unchanged_names(groups, stamps, self.stamps)

    def record(self, sent_names: Iterable[str], stamps: Mapping[str, Stamp] | None) -> None:
        """Record a push that landed: the engine now holds ``stamps`` for ``sent_names``."""
        if stamps is None:
            self.stamps = {}
            return
        self.stamps.update({name: stamps[name] for name in sent_names if name in stamps})
