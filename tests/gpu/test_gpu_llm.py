"""Everything a user does with an in-process ``vllm.LLM`` on one GPU over vLLM's ipc backend, on vLLM's own
engine (``scenarios.InProcessEngineScenarios``): ``Trainer.fit`` with ``VLLMWeightSync``, rollouts during training,
background and changed-only pushes, LoRA, a push that fails or times out half way, the engine core frozen mid-push,
100 pushes, and the engine core killed mid-push (last: it ends the shared engine)."""

from __future__ import annotations

from typing import Any

import pytest
from scenarios import InProcessEngineScenarios

pytestmark = pytest.mark.gpu


class TestInProcessLLMOverIPC(InProcessEngineScenarios):
    @pytest.fixture
    def llm(self, ipc_llm: Any) -> Any:
        return ipc_llm
