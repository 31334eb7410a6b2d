"""``AsyncLLM`` on the GPU over ipc, in each pause mode, with a request in flight during the push."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_a_push_in_each_pause_mode_lands_beside_a_request_in_flight(async_ipc_engine, mode):
    scenarios.push_beside_a_request_in_flight(async_ipc_engine, mode)
