"""Several engines behind one updater, and an engine with tensor parallelism."""

from __future__ import annotations

import pytest
from helpers import (
    TinyCausalLM,
    assert_serves,
    build_llm,
    build_llm_in_process,
    cpu_trainer,
    served_version,
    shutdown,
    tiny_qwen2,
    token_batches,
)
from vllm import SamplingParams

from lightning_vllm import VLLMUpdater, VLLMWeightSync
from lightning_vllm.engines.local import LocalLLMEngine

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def second_llm(model_dir):
    engine = build_llm_in_process(model_dir)  # (beside the shared engine, whose core runs in a process of its own)
    yield engine
    shutdown(engine)


def two_free_ports() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are free on loopback now (bounded: 50 tries)."""
    import socket

    from helpers import free_port

    for _ in range(50):
        port = free_port()
        try:
            with socket.create_server(("127.0.0.1", port + 1)):
                return port
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports in 50 tries")


def test_training_keeps_two_engines_in_sync(llm, second_llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    # A fixed master_port: engine i listens on master_port + i, so both groups form.
    sync = VLLMWeightSync(engine=[llm, second_llm], every_n_train_steps=2, master_port=two_free_ports())
    served_before = max(served_version(llm), served_version(second_llm))
    cpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))
    assert_serves(llm, module.hf)
    assert_serves(second_llm, module.hf)
    assert sync.updater.engine_indices() == [0, 1]
    # Both go on from the larger version either served: fit start and step 2.
    assert sync.updater.engine_versions() == {0: str(served_before + 2), 1: str(served_before + 2)}


def test_worker_ids_update_only_the_engines_named(llm, second_llm):
    first, second = tiny_qwen2(seed=60), tiny_qwen2(seed=61)
    updater = VLLMUpdater(engine=[llm, second_llm])
    # Both engines already served versions of their own: the count goes on after the larger.
    version = updater.push_weights(first).weight_version
    assert updater.engine_versions() == {0: str(version), 1: str(version)}
    updater.push_weights(second, worker_ids=[1])
    assert_serves(llm, first)
    assert_serves(second_llm, second)
    assert updater.engine_versions() == {0: str(version), 1: str(version + 1)}
    updater.push_weights(second, worker_ids=0)
    assert_serves(llm, second)
    assert updater.engine_versions() == {0: str(version + 2), 1: str(version + 1)}
    updater.close()


@pytest.fixture(scope="module")
def tp2_llm(model_dir):
    """tensor_parallel_size=2 on 2 cores: one core per worker (vLLM's CPU build cannot
    pick the binding itself on a single NUMA node)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        engine = build_llm(model_dir, tensor_parallel_size=2)
    yield engine
    shutdown(engine)


def test_tensor_parallel_workers_all_join_the_group(tp2_llm):
    model = tiny_qwen2(seed=62)
    updater = VLLMUpdater(engine=tp2_llm, vllm_tp_size=2)
    assert updater.engine.num_workers() == 2  # the group holds the trainer and both workers
    updater.push_weights(model)
    assert_serves(tp2_llm, model)
    assert tp2_llm.get_weight_version() == "1"
    updater.close()


def test_an_engine_that_cannot_be_reached_does_not_keep_the_push_from_the_others(llm):
    from helpers import free_port

    from lightning_vllm.errors import PartialPushError

    model = tiny_qwen2(seed=63)
    updater = VLLMUpdater(engine=[f"http://127.0.0.1:{free_port()}", llm], timeout_seconds=5)
    message = r"reached engine\(s\) \[1\] but failed on engine 0.*Cannot reach"
    with pytest.raises(PartialPushError, match=message) as caught:
        updater.push_weights(model)
    stats = caught.value.stats
    assert (stats.engine_indices, stats.failed_engine_indices) == ((1,), (0,))
    assert_serves(llm, model)
    assert updater.weight_version == stats.weight_version == served_version(llm)
    updater.close()


class RecordingEngine(LocalLLMEngine):
    """An in-process engine's target that records the prompts each generate gives it."""

    def __init__(self, llm) -> None:
        super().__init__(llm)
        self.prompts: list[list[int]] = []

    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        self.prompts += [list(prompt) for prompt in prompts]
        return super().generate(prompts, sampling_params, timeout_seconds=timeout_seconds)


def test_rollouts_are_spread_over_the_engines_by_default_and_come_back_in_prompt_order(llm, second_llm):
    first, second = RecordingEngine(llm), RecordingEngine(second_llm)
    updater = VLLMUpdater(engine=[first, second])
    updater.push_weights(tiny_qwen2(seed=8))
    sampler = VLLMWeightSync(updater=updater).rollouts
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8], [9]]
    rollouts = sampler.generate(prompts, SamplingParams(n=2, max_tokens=2, seed=0))
    assert [rollout.prompt_token_ids for rollout in rollouts] == [prompt for prompt in prompts for _ in range(2)]
    assert first.prompts == prompts[:2] and second.prompts == prompts[2:]
    assert {rollout.weight_version for rollout in rollouts} == {updater.weight_version}
    sampler.generate(prompts[:2], SamplingParams(max_tokens=1), engine_index=1)  # one engine, when named
    assert first.prompts == prompts[:2] and second.prompts == prompts[2:] + prompts[:2]
    updater.close()
