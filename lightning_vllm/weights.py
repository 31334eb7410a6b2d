"""What is sent: the Hugging Face model's weights, named as vLLM's loader expects.

vLLM loads weights by their Hugging Face checkpoint names (``model.layers.0...``,
``lm_head.weight``), so the names come from the Hugging Face model itself, not
from the LightningModule that wraps it. Metadata is read from parameter shapes
and dtypes only: nothing is copied or gathered until the transport asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from transformers import PreTrainedModel
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

ModelMetadata = dict[str, tuple[torch.dtype, torch.Size]]
"""``{parameter name: (dtype, shape)}``, the form TorchRL's ``vLLMUpdater`` uses."""


def find_hf_model(module: torch.nn.Module, attribute: str | None = None) -> torch.nn.Module:
    """The Hugging Face model whose weights vLLM serves.

    Args:
        module: a ``PreTrainedModel``, a LightningModule holding one, or any module.
        attribute: the LightningModule attribute holding the model (e.g. ``"model"``);
            found automatically when ``None``.

    Returns:
        ``module`` itself unless it is a LightningModule, else the model inside it.

    Raises:
        ValueError: the attribute is missing, or there is no single Hugging Face model.

    Example::

        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> hf = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=1, num_key_value_heads=1, vocab_size=32))
        >>> class Policy(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.policy = hf
        >>> find_hf_model(Policy()) is hf
        True
    """
    if attribute is not None:
        found = getattr(module, attribute, None)
        if not isinstance(found, torch.nn.Module):
            raise ValueError(
                f"{type(module).__name__} has no module attribute {attribute!r}; pass the name of the attribute "
                "that holds the Hugging Face model (model_attribute=...)."
            )
        return found
    if not isinstance(module, LightningModule):
        return module
    candidates = [
        name for name, child in module.named_modules() if name and isinstance(child, PreTrainedModel)
    ]
    # A PreTrainedModel nested in another one (e.g. Qwen2ForCausalLM.model) is part of it.
    outermost = [name for name in candidates if not any(name.startswith(other + ".") for other in candidates)]
    if len(outermost) == 1:
        return module.get_submodule(outermost[0])
    if not outermost:
        raise ValueError(
            f"{type(module).__name__} holds no Hugging Face PreTrainedModel; keep the policy as an attribute "
            "(e.g. self.model = AutoModelForCausalLM...) or name it with model_attribute=..."
        )
    raise ValueError(
        f"{type(module).__name__} holds several Hugging Face models ({', '.join(outermost)}); "
        "say which one vLLM serves with model_attribute=..."
    )


def model_metadata(module: torch.nn.Module) -> ModelMetadata:
    """``{name: (dtype, shape)}`` of every parameter, without copying or gathering any tensor.

    Example::

        >>> model_metadata(torch.nn.Linear(2, 3))
        {'weight': (torch.float32, torch.Size([3, 2])), 'bias': (torch.float32, torch.Size([3]))}
    """
    # A DTensor (FSDP2) reports its global shape here, so no gather happens.
    return {name: (param.dtype, torch.Size(param.shape)) for name, param in module.named_parameters()}


class ModuleWeights(WeightSource):
    """The parameters of a module, as a vLLM ``WeightSource``.

    Iteration materializes FSDP shards with ``full_tensor()`` one parameter at a
    time; dense parameters are yielded as they are, without a copy.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, dtype, tuple(shape)) for name, (dtype, shape) in model_metadata(self.module).items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            yield name, materialize_full_tensor(param.detach())


class PushSource(WeightSource):
    """The weights of the push under way, sent in the dtypes fixed at ``init``.

    vLLM's trainer engines take one ``WeightSource`` when they connect and replay it
    at every push; the updater swaps the weights behind it (``current``) before each
    push, after checking them against the metadata the engine was set up with. The
    wire dtype of each tensor is the one in that metadata (the engine's serving
    dtype); the order is the current weights' own, so they stream without reordering.
    """

    def __init__(self, metadata: Mapping[str, tuple[torch.dtype, Any]]) -> None:
        self.wire_dtypes = {name: dtype for name, (dtype, _) in metadata.items()}
        self.current: WeightSource | None = None

    def metadata(self) -> list[ParamMeta]:
        if self.current is None:
            raise RuntimeError("No weights are being pushed: set PushSource.current first.")
        return [ParamMeta(meta.name, self.wire_dtypes[meta.name], meta.shape) for meta in self.current.metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.current is None:
            raise RuntimeError("No weights are being pushed: set PushSource.current first.")
        return iter(self.current)


def metadata_problems(expected: Mapping[str, tuple[torch.dtype, Any]], actual: Mapping[str, tuple[torch.dtype, Any]]) -> list[str]:
    """What differs between the metadata an engine was set up with and the weights pushed now."""
    problems = [f"missing tensor {name!r}" for name in expected if name not in actual]
    problems += [f"unexpected tensor {name!r}" for name in actual if name not in expected]
    problems += [
        f"tensor {name!r} has shape {tuple(actual[name][1])}, expected {tuple(shape)}"
        for name, (_, shape) in expected.items()
        if name in actual and tuple(actual[name][1]) != tuple(shape)
    ]
    return problems
