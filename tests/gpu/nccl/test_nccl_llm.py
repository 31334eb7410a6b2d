"""Everything a user does with an in-process ``vllm.LLM`` over vLLM's ``nccl`` backend, on vLLM's own engine on the
one GPU, its engine core an NCCL host of its own (``nccl_hosts.py``): the scenarios of the ``ipc`` tier
(``scenarios.InProcessEngineScenarios``), each failure recording what the engine served afterwards and which version
it reported, the 100 pushes spread over 10 groups and counting what an NCCL communicator holds (descriptors,
threads), and the engine core killed mid-push (last: it ends the shared engine)."""

from __future__ import annotations

from typing import Any

import pytest
from scenarios import InProcessEngineScenarios

pytestmark = pytest.mark.gpu


class TestInProcessLLMOverNCCL(InProcessEngineScenarios):
    prefix = "nccl_"
    soak_groups = 10
    count_leaks = True

    @pytest.fixture
    def llm(self, nccl_llm: Any) -> Any:
        return nccl_llm
