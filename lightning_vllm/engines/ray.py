"""vLLM engines inside Ray actors.

:class:`VLLMActor` is a small actor class holding a ``vllm.LLM``; :class:`RayEngine`
drives one actor from the trainer. Every remote call is waited for with a timeout
by the updater. Ray's own serialization carries the calls: using Ray is the
user's opt-in to it.

Example::

    >>> import ray  # doctest: +SKIP
    >>> actor = ray.remote(num_cpus=1)(VLLMActor).remote(  # doctest: +SKIP
    ...     model=path, dtype="float32", weight_transfer_config={"backend": "gloo"})
    >>> sync = VLLMWeightSync(engine=actor)  # the handle is wrapped in a RayEngine  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import cached_property
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload

from lightning_vllm.engines.base import (
    Generation,
    NamesItsEngine,
    PauseMode,
    PolicyAdapter,
    ReportsLayerSums,
    ServesAdapter,
)
from lightning_vllm.engines.local import LocalLLMEngine
from lightning_vllm.engines.sleep import SleepMode
from lightning_vllm.errors import WeightSyncTimeoutError
from lightning_vllm.lora.serving import LoraLimits
from lightning_vllm.prompts import PromptLimits
from lightning_vllm.weights.checks import ExpectedWeights


class VLLMActor(LocalLLMEngine):
    """A ``vllm.LLM`` to run as a Ray actor (``ray.remote(VLLMActor).remote(**llm_kwargs)``).

    Args:
        **llm_kwargs: passed to ``vllm.LLM``; include ``weight_transfer_config``.
    """

    def __init__(self, **llm_kwargs: Any) -> None:
        from vllm import LLM

        super().__init__(LLM(**llm_kwargs))

    def describe(self) -> dict[str, Any]:
        """The facts the updater checks, in one remote call."""
        return {
            "transfer_backend": self.transfer_backend(),
            "device_type": self.device_type(),
            "tensor_parallel_size": self.tensor_parallel_size(),
            "num_workers": self.num_workers(),
            "expected_weights": self.expected_weights(),
            "prompt_limits": self.prompt_limits(),
            "lora_limits": self.lora_limits(),
            "adapter": self.adapter,
            "layer_sums_problem": self.layer_sums_problem(),
            "sleep_mode_enabled": self._sleep_mode_enabled(),
        }

    def ask_workers(self, method: str) -> list[Any]:
        """Every worker's answer to the worker method ``method`` (the trainer's ``RayEngine`` asks through it)."""
        return self._ask_workers(method)


def is_actor_handle(engine: Any) -> bool:
    """Whether ``engine`` is a Ray actor handle (without importing Ray when it is not loaded)."""
    import sys

    if "ray" not in sys.modules:
        return False
    from ray.actor import ActorHandle

    return isinstance(engine, ActorHandle)


class RayEngine(ServesAdapter, NamesItsEngine, ReportsLayerSums, SleepMode):
    """Engine target for a Ray actor running :class:`VLLMActor` (or any actor with the same methods)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.description = f"Ray actor {handle._actor_id.hex()[:8]}"

    def engine_key(self) -> Hashable:
        return "handle", id(self.handle)

    def _call(self, method: str, *args: Any, timeout_seconds: float | None = None) -> Any:
        """Call the actor's ``method`` and wait for its answer (at most ``timeout_seconds``; callers of
        control calls bound them too)."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_seconds)
        except GetTimeoutError as error:
            raise WeightSyncTimeoutError(
                f"{self.description} did not answer {method} within {timeout_seconds:g} s; it may be frozen or "
                "overloaded (raise generate_timeout_seconds for longer rollouts)."
            ) from error

    @cached_property
    def facts(self) -> dict[str, Any]:
        return self._call("describe")

    def transfer_backend(self) -> str | None:
        return self.facts["transfer_backend"]

    def device_type(self) -> str:
        return str(self.facts["device_type"])

    def tensor_parallel_size(self) -> int:
        return int(self.facts["tensor_parallel_size"])

    def num_workers(self) -> int:
        return int(self.facts["num_workers"])

    def expected_weights(self) -> ExpectedWeights | None:
        return self.facts["expected_weights"]

    def prompt_limits(self) -> PromptLimits:
        return self.facts["prompt_limits"]

    def lora_limits(self) -> LoraLimits | None:
        return self.facts["lora_limits"]

    @property
    def adapter(self) -> PolicyAdapter | None:
        """The adapter the actor generates through. The actor keeps it, and another ``RayEngine``
        (an earlier updater's) may have set it: read from the actor with its other facts."""
        return self.facts.get("adapter")

    @adapter.setter
    def adapter(self, adapter: PolicyAdapter | None) -> None:  # (ServesAdapter's is a plain attribute)
        self.serve_adapter(adapter)

    def serve_adapter(self, adapter: PolicyAdapter | None) -> None:
        """The actor generates, so it is the one told which adapter to use."""
        self._call("serve_adapter", adapter)
        self.facts["adapter"] = adapter

    def layer_sums_problem(self) -> str | None:
        return self.facts.get("layer_sums_problem", "the actor does not say whether its workers report their sums")

    def layer_sums(self) -> list[dict[str, Any]]:
        return list(self._call("layer_sums"))

    def _sleep_mode_enabled(self) -> bool:
        return bool(self.facts.get("sleep_mode_enabled"))

    def _ask_workers(self, method: str) -> list[Any]:
        return list(self._call("ask_workers", method))

    def sleep(self, level: int, mode: str) -> None:
        self._call("sleep", level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake_up", tags)

    def is_dead(self) -> bool:
        """A dead actor fails its calls with ``RayActorError``; a busy one cannot be asked."""
        return False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str | None:
        return self._call("get_weight_version")

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def pause_generation(self, mode: PauseMode) -> None:
        """Nothing to pause: the actor runs one call at a time, so no request overlaps an update."""

    def resume_generation(self) -> None:
        """Nothing to resume."""

    def generate(
        self, prompts: Sequence[list[int] | str], sampling_params: Any, *, timeout_seconds: float | None = None
    ) -> list[Generation]:
        return self._call("generate", prompts, sampling_params, timeout_seconds=timeout_seconds)
