"""What changed since the last push, told without reading a byte of any tensor.

A tensor's *stamp* is the tensor itself (held weakly), its storage address and its version counter
(``Tensor._version``), which PyTorch bumps at every in-place write: an optimizer
step, ``copy_``, ``load_state_dict``. A parameter nobody wrote since the last push
(a frozen embedding, a parameter with ``requires_grad=False``, a layer no gradient
reached) keeps its stamp, and the engine already holds it. Writes through
``tensor.data`` bypass the counter: code that trains that way must push with
``changed_only=False``.

vLLM's layer-wise reload processes a layer once every tensor of it has arrived, and
fills a layer that received only some of its tensors with uninitialised memory; one
that received none keeps its weights. So what is left out is whole layer groups (a
decoder layer, the embeddings before them, the norm and head after them), never
single tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor


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
        if all(same_stamp(sent.get(member), stamps.get(member)) for member in group)
        for name in group
    }


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

    def landed(self, sent_names: Iterable[str], stamps: Mapping[str, Stamp] | None) -> None:
        """Record a push that landed: the engine now holds ``stamps`` for ``sent_names``."""
        if stamps is None:
            self.stamps = {}
            return
        self.stamps.update({name: stamps[name] for name in sent_names if name in stamps})
