"""A vLLM engine inside a Ray actor on a local Ray cluster started by the test."""

from __future__ import annotations

import pytest
from helpers import assert_serves, tiny_qwen2

from lightning_vllm import RayEngine, VLLMUpdater

pytestmark = pytest.mark.engine


def test_the_ray_adapter_reports_what_the_updater_checks(actor):
    engine = RayEngine(actor)
    assert (engine.transfer_backend(), engine.device_type(), engine.num_workers()) == ("gloo", "cpu", 1)


def test_a_ray_actor_beside_an_in_process_engine(actor, llm):
    model = tiny_qwen2(seed=80)
    updater = VLLMUpdater(engine=[llm, actor])
    stats = updater.push_weights(model, worker_ids=[1])
    assert_serves(RayEngine(actor), model)
    assert updater.engine_versions()[1] == str(stats.weight_version)
    updater.close()
