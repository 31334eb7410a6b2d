"""TorchRL's documented weight-sync-scheme usage, with only the import changed, on a real in-process ``vllm.LLM``
(gloo) that an ``LLMCollector``'s ``vLLMWrapper`` policy samples from: after each ``update_weights`` vLLM serves the
registered model (greedy tokens and prompt logprobs, float32, 1e-4), the collected rollouts' logprobs are the model's,
and the collector's policy version moved by one (``track_policy_version=True``)."""

from __future__ import annotations

import pytest
from helpers import TOLERANCE, assert_serves, free_port, tiny_qwen2

from lightning_vllm import EngineConfigError

pytestmark = pytest.mark.engine

torchrl = pytest.importorskip("torchrl", reason="the torchrl extra (make test installs it)")

from torchrl_collectors import assert_in_step, documented_scheme_usage, llm_collector  # noqa: E402

from lightning_vllm.torchrl import VLLMWeightSyncScheme, get_model_metadata  # noqa: E402


def test_torchrls_documented_scheme_usage_keeps_vllm_and_the_collector_in_step(llm):
    model = tiny_qwen2(seed=1).eval()
    scheme = VLLMWeightSyncScheme(master_port=free_port(), gpus_per_replica=1, num_replicas=1)

    def serves_the_model(step: int) -> None:
        # Greedy tokens and prompt logprobs. (After a second step at lr 0.5 this tiny model's prompt logprobs reach
        # vLLM's CPU kernels' floor, 1.8e-3 measured: the third push is checked on its rollout's logprobs.)
        if step < 2:
            assert_serves(llm, model)

    records = documented_scheme_usage(llm, model, scheme, pushes=3, after_push=serves_the_model)
    assert_in_step(records, TOLERANCE)


def test_torchrls_generic_scheme_call_pushes_the_registered_model(llm):
    """``scheme.send()``, what TorchRL's collectors call with ``weight_sync_schemes``, pushes through the sender."""
    model = tiny_qwen2(seed=4).eval()
    collector = llm_collector(llm)
    scheme = VLLMWeightSyncScheme(master_port=free_port())
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.register_collector(collector)
    sender.init_all_workers_group(get_model_metadata(model), vllm_engine=llm)
    try:
        before, version = collector.policy_version, sender.weight_version
        scheme.send()
        assert (collector.policy_version, sender.weight_version) == (before + 1, version + 1)
        assert llm.get_weight_version() == str(sender.weight_version)
        assert_serves(llm, model)
    finally:
        sender.shutdown()
        collector.shutdown()


def test_torchrls_own_metadata_helper_is_taken_too(llm):
    from torchrl.weight_update.llm import get_model_metadata as torchrl_metadata

    model = tiny_qwen2(seed=2).eval()
    sender = VLLMWeightSyncScheme(master_port=free_port()).create_sender()
    sender.init_all_workers_group(torchrl_metadata(model), vllm_engine=llm)
    try:
        sender.update_weights(model)
        assert_serves(llm, model)
    finally:
        sender.shutdown()


@pytest.mark.parametrize(
    ("layout", "message"),
    [({"num_replicas": 2}, "num_replicas=2. but 1 engine"), ({"gpus_per_replica": 2}, "runs 1 worker")],
)
def test_a_layout_the_engine_does_not_have_is_refused_before_a_byte_moves(llm, layout, message):
    version = llm.get_weight_version()
    sender = VLLMWeightSyncScheme(master_port=free_port(), **layout).create_sender()
    with pytest.raises(EngineConfigError, match=message):
        sender.init_all_workers_group(get_model_metadata(tiny_qwen2(seed=3)), vllm_engine=llm)
    assert llm.get_weight_version() == version
