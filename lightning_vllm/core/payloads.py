"""What a push sends, chosen once: the policy's full (or merged) weights, its LoRA adapter alone, or
its base weights with the adapter; and the stamps a changed-only push compares.

:func:`choose_payload` is the only place this is decided. The updater calls it (and the
trainer's ranks, through the updater, agree on its decision); everything after it, the
connection, a background snapshot, a sharded walk, handles the :class:`Payload` it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightSource

from lightning_vllm.lora.adapter import NOT_A_LORA_POLICY, adapter_source, lora_policy
from lightning_vllm.lora.serving import choose_view
from lightning_vllm.options import UpdaterOptions
from lightning_vllm.weights import weights_from
from lightning_vllm.weights.payload import Payload, PushView


def choose_payload(
    weights: Any,
    options: UpdaterOptions,
    engines_serving: Callable[[torch.nn.Module], tuple[list[str], bool]],
    agree: Callable[[Callable[[], PushView]], PushView] | None = None,
) -> Payload:
    """What a push of ``weights`` carries, under the updater's ``options``.

    A ready ``WeightSource``, and any policy when ``lora="merged"``, is sent as it is (a
    LoRA policy merged). A PEFT LoRA policy otherwise sends its adapter alone when every
    engine can serve it, and the base weights with it while an engine lacks them.

    Args:
        weights: a Hugging Face or PEFT model, a LightningModule holding one, a dict, a
            TensorDict or a ``WeightSource``.
        options: the updater's ``lora``, ``model_attribute`` and ``changed_only``.
        engines_serving: for a LoRA policy, why some engine cannot serve its adapter (a list
            of reasons) and whether every engine already has its base weights.
        agree: given the decision, returns the one every trainer rank takes (``None``: this
            process decides alone).

    Raises:
        EngineConfigError: ``lora="adapter"`` but an engine cannot serve the adapter (says why).
        ValueError: ``lora="adapter"`` but ``weights`` is not a PEFT LoRA policy.
    """
    policy = None if isinstance(weights, WeightSource) else lora_policy(weights, options.model_attribute)

    def decide() -> PushView:
        if options.lora == "merged" or isinstance(weights, WeightSource):
            return "merged"
        if policy is None:
            if options.lora == "adapter":
                raise ValueError(NOT_A_LORA_POLICY)
            return "merged"
        problems, engines_have_base = engines_serving(policy)
        return choose_view(options.lora, problems, engines_have_base)

    view = decide() if agree is None else agree(decide)
    if view == "merged":
        source = weights_from(weights, options.model_attribute)
        return Payload(source, view, stamps=source.stamps() if options.changed_only else None)
    assert policy is not None, "an adapter view is chosen for a LoRA policy only"
    source, config = adapter_source(policy, with_base=view == "base_and_adapter")
    return Payload(source, view, adapter_config=config)
