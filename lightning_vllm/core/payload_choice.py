"""What a push sends: the policy's full (or merged) weights, its LoRA adapter alone, or its base weights with the
adapter; and the stamps a changed-only push compares.

The decision is :func:`choose_view`, a pure function of the weights, their LoRA policy (:func:`policy_of`, found
once), the options and the engines' facts (``core/facts.py``, read when connecting, and only for a LoRA policy:
:func:`needs_facts`); :func:`payload_for` then builds the :class:`Payload` of that view, on every trainer rank
alike. ``WeightSync.choose_view`` and ``choose_payload`` run them (connecting first when the facts are needed; a
sharded push takes rank 0's view on every rank), and ``KeptChoice`` (``weights/payload.py``) keeps a push's payload
for the next push of the same unchanged model. Everything after it, the connection, a background snapshot, a sharded
walk, handles the payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightSource

from lightning_vllm.core.facts import EngineFacts
from lightning_vllm.lora.adapter import NOT_A_LORA_POLICY, adapter_source, lora_policy
from lightning_vllm.lora.serving import adapter_problems, choose_view_of_problems
from lightning_vllm.options import UpdaterOptions
from lightning_vllm.weights import weights_from
from lightning_vllm.weights.payload import Payload, PushView
from lightning_vllm.weights.survey import Surveys


def policy_of(weights: Any, options: UpdaterOptions, surveys: Surveys | None = None) -> torch.nn.Module | None:
    """The PEFT LoRA policy inside ``weights`` whose adapter could go alone, else ``None`` (a ready
    ``WeightSource`` is sent as it is). Found once per push: it walks the module tree (``surveys``: the
    push's, which :func:`payload_for` reads again)."""
    if isinstance(weights, WeightSource):
        return None
    return lora_policy(weights, options.model_attribute, surveys=surveys or Surveys())


def needs_facts(policy: torch.nn.Module | None, options: UpdaterOptions) -> bool:
    """Whether choosing a payload reads the engines' facts: a LoRA policy (:func:`policy_of`) that may go
    as an adapter. Anything else is chosen without asking an engine."""
    return policy is not None and options.lora != "merged"


def choose_view(
    weights: Any,
    policy: torch.nn.Module | None,
    options: UpdaterOptions,
    facts: Sequence[EngineFacts],
    extra_problems: Sequence[str] = (),
) -> PushView:
    """How a push of ``weights`` (whose LoRA policy, if any, is ``policy``: :func:`policy_of`) sends the
    policy (see :data:`PushView`), under ``options``, given the facts of every engine it goes to (read
    only for a LoRA policy: :func:`needs_facts`) and ``extra_problems``, why something else that samples
    from the engines could not use an adapter.

    Raises:
        EngineConfigError: ``lora="adapter"`` but an engine cannot serve the adapter (says why).
        ValueError: ``lora="adapter"`` but ``weights`` is not a PEFT LoRA policy.
    """
    if options.lora == "merged" or isinstance(weights, WeightSource):
        return "merged"
    if policy is None:
        if options.lora == "adapter":
            raise ValueError(NOT_A_LORA_POLICY)
        return "merged"
    problems = [
        f"{engine.description}: {problem}"
        for engine in facts
        for problem in engine.lora_problems
        or adapter_problems(policy, engine.lora_limits, engine.expected, engine.description)
    ]
    engines_have_base = all(engine.has_policy_base for engine in facts)
    return choose_view_of_problems(options.lora, [*problems, *extra_problems], engines_have_base)


def payload_for(
    weights: Any,
    policy: torch.nn.Module | None,
    view: PushView,
    options: UpdaterOptions,
    surveys: Surveys | None = None,
) -> Payload:
    """The payload of ``weights`` (whose LoRA policy is ``policy``) sent as ``view``: its tensors, its LoRA
    adapter's config and its stamps (``surveys``: the push's, :func:`policy_of`'s)."""
    if view == "merged":
        source = weights_from(weights, options.model_attribute, surveys or Surveys())
        return Payload(source, view, stamps=source.stamps() if options.changed_only else None)
    assert policy is not None, "an adapter view is chosen for a LoRA policy only"
    source, config = adapter_source(policy, with_base=view == "base_and_adapter")
    return Payload(source, view, adapter_config=config)
