"""What connecting to an engine tells: its facts, which the choice of a payload reads."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vllm.backends.base import Traits
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
