"""What connecting to an engine tells: its facts, which the choice of a payload reads, and its LoRA side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_vllm.backends.base import Backend, Traits
from lightning_vllm.backends.registry import carrying
from lightning_vllm.engines import EngineTarget
from lightning_vllm.engines.base import ServesLoraAdapters
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.lora.serving import LoraLimits
from lightning_vllm.weights.checks import ExpectedWeights


@dataclass(frozen=True)
class EngineFacts:
    """One connected engine, as a push's choice sees it (``EngineConnection.facts``).

    Attributes:
        description: the engine, as errors name it.
        traits: its backend's traits.
        lora_limits: its LoRA settings (``None``: built without LoRA, or not asked: see ``lora_problems``).
        expected: what its model loads (``None`` when the LoRA settings were not asked).
        lora_problems: why it cannot serve any adapter (its backend, its target, a server's middleware).
        has_policy_base: this connection gave it the policy's base weights, after which an adapter
            push sends the adapter alone.
    """

    description: str
    traits: Traits
    lora_limits: LoraLimits | None
    expected: ExpectedWeights | None
    lora_problems: tuple[str, ...]
    has_policy_base: bool


def lora_facts(
    engine: EngineTarget, backend: Backend, call: Callable[..., Any]
) -> tuple[LoraLimits | None, ExpectedWeights | None, list[str]]:
    """What ``engine``, over ``backend``, says of serving LoRA adapters: its LoRA settings, what its model loads, and
    why it cannot serve any (``[]``: it can). ``call(fn, what=...)`` asks the engine within the timeout."""
    problems: list[str] = []
    if not backend.traits.carries_adapters:
        problems.append(
            f"adapter pushes need the {' or '.join(carrying('carries_adapters'))} backend; the "
            f"{engine.description} engine uses {backend.name!r}"
        )
        return None, None, problems
    if not isinstance(engine, ServesLoraAdapters):
        return None, None, [f"the {engine.description} engine target does not declare ServesLoraAdapters"]
    limits = call(engine.lora_limits, what=f"{engine.description}'s LoRA settings")
    expected = call(engine.expected_weights, what=f"{engine.description}'s model facts")
    if limits is not None:
        try:
            call(engine.check_serves_adapters, what=f"{engine.description} to describe its LoRA routes")
        except EngineConfigError as error:
            problems.append(str(error))
    return limits, expected, problems
