"""transformers' weight conversion, reversed: the one module that reads ``transformers.core_model_loading``.

``revert_weight_conversion`` (what ``save_pretrained`` runs) takes a whole state dict and copies every chunk it
makes; a push streams and sends views, so ``checkpoint_layout.py`` (whose docstring says how) runs the same reversed
transforms in two steps: :meth:`ReversedConversion.group_of`, then :meth:`ReversedConversion.run`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lightning_vllm.errors import WeightsMismatchError
from lightning_vllm.weights.model import canonical_name

REFUSED = "nothing was sent and vLLM keeps its weights. Push the weights in the checkpoint's layout as a dict instead."


class ReversedConversion:
    """The reverse of the transforms transformers loads ``model`` with, as ``revert_weight_conversion`` builds it.

    Build it with :meth:`of`, which returns ``None`` for a model transformers loads as it is saved.
    """

    def __init__(self, transforms: list[Any]) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        reverse = [transform.reverse_transform() for transform in transforms[::-1]]  # the last first
        self._renamings = [entry for entry in reverse if isinstance(entry, WeightRenaming)]
        self._converters = [entry for entry in reverse if isinstance(entry, WeightConverter)]
        self._by_pattern = {pattern: entry for entry in self._converters for pattern in entry.source_patterns}

    @classmethod
    def of(cls, model: torch.nn.Module) -> ReversedConversion | None:
        """The reversed conversion of ``model`` (a ``PreTrainedModel``), or ``None`` where there is none.

        Raises:
            WeightsMismatchError: a transform has no reverse (names the tensors it makes).
        """
        transforms = _transforms_of(model)
        for transform in transforms:
            try:
                transform.reverse_transform()
            except (ValueError, NotImplementedError) as error:
                raise WeightsMismatchError(
                    f"transformers cannot turn {type(model).__name__}'s {', '.join(_made_by(transform, model))} back "
                    f"into the checkpoint's layout that vLLM loads ({type(error).__name__}: {error or 'no reverse'}); "
                    f"{REFUSED}"
                ) from error
        return cls(transforms) if transforms else None

    def group_of(self, name: str) -> tuple[str, str | None]:
        """``(key, pattern)``: the group ``name`` joins and the pattern it matched, or ``(new name, None)`` for a
        tensor only renamed. Ask in ``dot_natural_key`` order of the names, as transformers does."""
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(name, self._renamings, self._converters, reverse=True)

    def run(self, key: str, patterns: tuple[str, ...], inputs: list[torch.Tensor], config: Any) -> dict[str, Any]:
        """The checkpoint tensors, by full name, that group ``key`` (inputs matched ``patterns``) makes of
        ``inputs``: ``WeightConverter.convert``'s steps, with ``Chunk`` as views."""
        converter = self._by_pattern[patterns[0]]
        collected: dict[str, Any] = {}
        for pattern, tensor in zip(patterns, inputs):
            collected.setdefault(pattern, []).append(tensor)
        for operation in converter.operations:
            collected = _apply(
                operation,
                collected,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=key,
                config=config,
            )
        # As WeightConverter.convert names them: each target within the full name of the group.
        full_name = key.replace("*.", "0.")
        named = next((full_name.partition(target) for target in collected if target in full_name), None)
        prefix, suffix = (named[0], named[2]) if named is not None else ("", "")
        return {prefix + target + suffix: _single(value) for target, value in collected.items()}


def natural_order(names: list[str]) -> list[str]:
    """``names`` in the order transformers converts a state dict (``dot_natural_key``)."""
    from transformers.core_model_loading import dot_natural_key

    return sorted(names, key=dot_natural_key)


def _transforms_of(model: torch.nn.Module) -> list[Any]:
    """The transforms ``save_pretrained`` reverses for ``model``, as ``revert_weight_conversion`` finds them: those
    its loading used, else the model type's registered ones, less prefix changes (a model built from its config
    has no prefix to restore)."""
    from transformers.core_model_loading import PrefixChange

    used = getattr(model, "_weight_conversions", None)
    if used is not None:
        return list(used)
    from transformers.conversion_mapping import get_model_conversion_mapping

    transforms = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
    return [transform for transform in transforms if not isinstance(transform, PrefixChange)]


def _made_by(transform: Any, model: torch.nn.Module) -> list[str]:
    """The tensors of ``model`` that ``transform`` makes when loading (its targets, ``*`` any index)."""
    targets = [re.compile(re.escape(target).replace(r"\*", r"\d+")) for target in transform.target_patterns]
    names = [canonical_name(name) for name, _ in model.state_dict(keep_vars=True).items()]
    return [name for name in names if any(target.search(name) for target in targets)] or list(transform.target_patterns)


def _single(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, list) else value


def _apply(operation: Any, collected: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    from transformers.core_model_loading import Chunk

    if type(operation) is not Chunk:
        return operation.convert(collected, **kwargs)
    # transformers' Chunk.convert, without its copy of each chunk into contiguous memory.
    if len(collected) > 1:
        raise ValueError("Chunk takes one tensor")
    tensor = _single(next(iter(collected.values())))
    targets = operation.get_target_patterns(kwargs["target_patterns"], config=kwargs["config"])
    return dict(zip(targets, torch.chunk(tensor, len(targets), dim=operation.dim)))
