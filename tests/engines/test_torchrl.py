"""TorchRL's own LLM stack drives our updater: an ``LLMCollector`` over a ``ChatEnv``, its
``vLLMWrapper`` policy generating with a real in-process ``vllm.LLM``.

The collected rollouts are the proof: after each push their response log-probs, computed
by vLLM while collecting, equal the pushed Hugging Face model's, and they carry the
collector's new policy version.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TOLERANCE,
    TinyCausalLM,
    assert_serves,
    cpu_trainer,
    lora_policy,
    served_version,
    tiny_qwen2,
    token_batches,
)
from torchrl_collectors import hf_response_log_probs, llm_collector, rollout_of, train_on

from lightning_vllm import EngineConfigError, VLLMWeightSync, WeightsMismatchError, vLLMUpdater

pytestmark = pytest.mark.engine

torchrl = pytest.importorskip("torchrl", reason="the torchrl extra (make test installs it)")


@pytest.fixture
def collector(llm):
    start = tiny_qwen2(seed=1)
    # As with TorchRL's own vLLMUpdater: metadata only; the engine is the collector policy's.
    updater = vLLMUpdater(model_metadata=vLLMUpdater.get_model_metadata(start))
    collector = llm_collector(llm, updater)
    yield collector, updater, start
    updater.close()
    collector.shutdown()


def test_an_llm_collector_collects_from_the_weights_it_pushed(collector, llm):
    collector, updater, model = collector
    assert updater.collector is collector
    batches = iter(collector)

    for expected_version in (1, 2):
        collector.update_policy_weights_(model)  # the collector calls our updater, then counts
        assert collector.policy_version == expected_version
        assert llm.get_weight_version() == str(updater.weight_version)
        prompt, response, vllm_log_probs, version = rollout_of(next(batches))
        assert version == expected_version
        assert len(response) == 6
        served = hf_response_log_probs(model, prompt, response)
        assert torch.allclose(vllm_log_probs, served, atol=TOLERANCE), (vllm_log_probs, served)
        trained = train_on(model, prompt, response)
        # The step moved the weights enough that serving the old ones would fail the check above.
        assert (hf_response_log_probs(trained, prompt, response) - served).abs().max() > 100 * TOLERANCE
        model = trained

    # Called directly (as a trainer that owns the updater does), the push still counts once.
    engine_version = updater.weight_version
    updater(model)
    assert collector.policy_version == 3 and updater.weight_version == engine_version + 1
    prompt, response, vllm_log_probs, version = rollout_of(next(batches))
    assert version == 3
    assert torch.allclose(vllm_log_probs, hf_response_log_probs(model, prompt, response), atol=TOLERANCE)


def test_a_refused_push_through_the_collector_counts_no_version(collector, llm):
    collector, updater, model = collector
    collector.update_policy_weights_(model)
    served_version = llm.get_weight_version()
    wrong = {name: tensor for name, tensor in model.state_dict().items() if "layers.1." not in name}
    with pytest.raises(WeightsMismatchError):
        collector.update_policy_weights_(wrong)
    assert collector.policy_version == 1 and llm.get_weight_version() == served_version
    prompt, response, vllm_log_probs, version = rollout_of(next(iter(collector)))
    assert version == 1
    assert torch.allclose(vllm_log_probs, hf_response_log_probs(model, prompt, response), atol=TOLERANCE)


def test_a_lora_policy_reaches_the_collector_as_merged_weights(llm):
    """The engine serves LoRA, but TorchRL's vLLMWrapper generates without our LoRA request:
    ``lora="auto"`` pushes merged weights, ``lora="adapter"`` says why it cannot."""
    policy = lora_policy(seed=3)
    refusing = vLLMUpdater(lora="adapter")
    refusing_collector = llm_collector(llm, refusing)
    try:
        with pytest.raises(EngineConfigError, match=r"collector's policy \(vLLMWrapper\) generates without"):
            refusing_collector.update_policy_weights_(policy)
        assert refusing_collector.policy_version == 0
    finally:
        refusing.close()
        refusing_collector.shutdown()

    updater = vLLMUpdater()  # lora="auto"
    collector = llm_collector(llm, updater)
    try:
        collector.update_policy_weights_(policy)
        assert updater.lora_request is None  # nothing to pass: the engine's weights are the merged policy
        prompt, response, vllm_log_probs, version = rollout_of(next(iter(collector)))
        assert version == 1
        served = hf_response_log_probs(policy, prompt, response)
        assert torch.allclose(vllm_log_probs, served, atol=TOLERANCE), (vllm_log_probs, served)
    finally:
        updater.close()
        collector.shutdown()


class CollectingPolicy(TinyCausalLM):
    """Collects a rollout from a TorchRL collector in every training step, checks it against
    the module's own weights, and makes the collected response more likely."""

    def __init__(self, model, collector) -> None:
        super().__init__(model, lr=0.5)
        self.collector = collector
        self.versions: list[int] = []
        self.log_prob_errors: list[float] = []

    def on_fit_start(self) -> None:
        self.batches = iter(self.collector)

    def training_step(self, batch, batch_idx):
        prompt, response, vllm_log_probs, version = rollout_of(next(self.batches))
        log_probs = hf_response_log_probs(self.hf, prompt, response)
        self.versions.append(version)
        self.log_prob_errors.append((log_probs.detach() - vllm_log_probs).abs().max().item())
        return -log_probs.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_a_lightning_run_collects_with_torchrl_from_the_weights_it_trains(llm, tmp_path):
    """The callback pushes through TorchRL's updater, the other front end on the same core; the collector
    built on that updater counts the versions."""
    updater = vLLMUpdater(engine=llm)
    sync = VLLMWeightSync(updater=updater, every_n_train_steps=1)
    collector = llm_collector(llm, updater)
    module = CollectingPolicy(tiny_qwen2(seed=2), collector)
    try:
        cpu_trainer(tmp_path, [sync], max_steps=3).fit(module, token_batches(3))
    finally:
        collector.shutdown()
    # The fit-start push is version 1, then one push after each step.
    assert module.versions == [1, 2, 3] and collector.policy_version == 4
    assert max(module.log_prob_errors) < TOLERANCE, module.log_prob_errors


def test_torchrls_per_worker_hook_commits_through_the_same_push_as_push_weights(llm):
    """TorchRL's ``WeightUpdaterBase.push_weights`` calls ``_sync_weights_with_worker`` per engine. It is
    one push like any other: checked, committed by the updater, then ``push_weights`` commits the next
    version with other weights (before the fix the engine held N+1 while the updater said N, and the
    next push committed N+1 again: one version, two sets of weights)."""
    first, second, third = tiny_qwen2(seed=41), tiny_qwen2(seed=42), tiny_qwen2(seed=43)
    updater = vLLMUpdater(engine=llm)
    try:
        updater.push_weights(first)
        seen = [(updater.weight_version, served_version(llm))]
        updater._sync_weights_with_worker(worker_id=0, server_weights=second)
        seen.append((updater.weight_version, served_version(llm)))
        assert_serves(llm, second)
        updater.push_weights(third)
        seen.append((updater.weight_version, served_version(llm)))
    finally:
        updater.close()
    start = seen[0][0]
    assert seen == [(start, start), (start + 1, start + 1), (start + 2, start + 2)]
    assert_serves(llm, third)


def test_torchrls_own_push_weights_goes_through_the_same_push(llm):
    """Called as TorchRL's base class calls it (``_push_weights`` -> ``_sync_weights_with_worker`` for every
    worker id): a bad dict is refused before a byte moves, like any push, and no version moves."""
    from torchrl.collectors import WeightUpdaterBase

    model = tiny_qwen2(seed=44)
    updater = vLLMUpdater(engine=llm)
    try:
        updater.push_weights(model)
        before = (updater.weight_version, served_version(llm))
        wrong = {name: tensor for name, tensor in model.state_dict().items() if "layers.1." not in name}
        with pytest.raises(WeightsMismatchError):
            WeightUpdaterBase._push_weights(updater, policy_or_weights=wrong)
        assert (updater.weight_version, served_version(llm)) == before
        WeightUpdaterBase._push_weights(updater, policy_or_weights=tiny_qwen2(seed=45))
        assert (updater.weight_version, served_version(llm)) == (before[0] + 1, before[1] + 1)
        assert_serves(llm, tiny_qwen2(seed=45))
    finally:
        updater.close()
