"""Rollouts from inside training_step: versions, staleness and its limit."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import (
    MAX_MODEL_LEN,
    VOCAB_SIZE,
    FakeEngine,
    TinyCausalLM,
    cpu_trainer,
    served_version,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
)
from torch.utils.data import DataLoader
from vllm import SamplingParams

from lightning_vllm import (
    EngineDeadError,
    StaleRolloutsError,
    VLLMUpdater,
    VLLMWeightSync,
    WeightSyncTimeoutError,
    generate,
)
from lightning_vllm.engines.base import version_number
from lightning_vllm.fronts.lightning.rollouts import RolloutSampler, sampler_of


class RolloutModule(TinyCausalLM):
    """Samples from vLLM in every training step and records what came back."""

    def __init__(self, versions_ahead: int = 0) -> None:
        super().__init__(tiny_qwen2(seed=0), lr=1e-3)
        self.versions_ahead = versions_ahead
        self.rollouts: list = []
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        updater = sampler_of(self).updater
        for _ in range(self.versions_ahead):
            updater.versions.count_one()  # the trainer counts versions vLLM never got
        rollouts = generate(self, [[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=3, logprobs=0, seed=0))
        self.rollouts.append(rollouts)
        self.seen.append((self.global_step, rollouts[0].weight_version, updater.weight_version))
        return super().training_step(batch, batch_idx)


@pytest.mark.engine
def test_rollouts_carry_the_version_that_produced_them(llm, tmp_path):
    module = RolloutModule()
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, max_staleness=0)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
    v = served_version(llm)  # the shared engine's count goes on
    trainer.fit(module, token_batches(num_batches=4))
    # Pushes at fit start (v+1) and after steps 2 (v+2) and 4 (v+3); step s samples from the latest.
    assert module.seen == [
        (0, v + 1, v + 1),
        (1, v + 1, v + 1),
        (2, v + 2, v + 2),
        (3, v + 2, v + 2),
    ]
    assert [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/staleness")] == [0.0] * 4
    for rollouts in module.rollouts:
        assert len(rollouts) == 4 and all(len(r.token_ids) == 3 and len(r.logprobs) == 3 for r in rollouts)
        assert [r.prompt_token_ids for r in rollouts] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]


def test_rollouts_older_than_max_staleness_are_refused(tmp_path):
    module = RolloutModule(versions_ahead=2)
    sync = VLLMWeightSync(engine=FakeEngine(module.hf), every_n_train_steps=1, max_staleness=1)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=2)
    message = r"weight version 1 are 2 versions behind the trainer \(version 3\).*max_staleness=1"
    with pytest.raises(StaleRolloutsError, match=message):
        trainer.fit(module, token_batches(num_batches=2))


def test_staleness_is_logged_when_allowed(tmp_path):
    module = RolloutModule(versions_ahead=1)
    sync = VLLMWeightSync(engine=FakeEngine(module.hf), every_n_train_steps=0)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=2)
    trainer.fit(module, token_batches(num_batches=2))
    assert [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/staleness")] == [1.0, 2.0]


def test_the_versions_keep_the_oldest_version_sampled_until_asked():
    updater = VLLMUpdater()
    sampler = RolloutSampler(updater, max_staleness=None)
    assert updater.versions.take_staleness() is None
    updater.weight_version = 5
    sampler.record([5, 3])
    sampler.record([4, 0])  # 0: the weights the engine started with
    assert updater.versions.take_staleness() == 5
    assert updater.versions.take_staleness() is None  # forgotten once taken


def test_version_strings_become_numbers():
    assert [version_number(v) for v in ("12", "default", None, "v3")] == [12, 0, 0, 0]


def test_generate_needs_the_callback(tmp_path):
    module = TinyCausalLM(tiny_qwen2())
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        generate(module, [[1, 2]])
    cpu_trainer(tmp_path, [], max_steps=1).fit(module, token_batches(num_batches=1))
    with pytest.raises(RuntimeError, match="0 VLLMWeightSync callbacks"):
        generate(module, [[1, 2]])


def test_a_rank_without_an_engine_cannot_generate():
    with pytest.raises(RuntimeError, match="holds no vLLM engine"):
        VLLMWeightSync().generate([[1, 2]])


class GatedEngine(FakeEngine):
    """A fake engine whose generate blocks until the test opens the gate (a frozen engine)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.gate = threading.Event()
        self.num_generates = 0

    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        self.num_generates += 1
        assert self.gate.wait(30), "the test never opened the gate"
        return super().generate(prompts, sampling_params)


def test_a_generate_that_never_returns_times_out_and_the_engine_is_usable_once_it_answers():
    engine = GatedEngine(tiny_qwen2())
    sampler = RolloutSampler(VLLMUpdater(engine=engine), timeout_seconds=0.3)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"Timed out after 0.3 s waiting for fake test engine to generate"):
        sampler.generate([[1, 2]])
    assert time.monotonic() - start < 2
    # Still frozen: the next generate waits for the one that timed out, then says so.
    with pytest.raises(WeightSyncTimeoutError, match="still not finished an earlier generate that timed out"):
        sampler.generate([[1, 2]], timeout_seconds=0.2)
    assert engine.num_generates == 1  # never two generates on one engine at once
    engine.gate.set()
    (generation,) = sampler.generate([[3, 4]])
    assert generation.prompt_token_ids == [3, 4]


def test_bad_prompts_never_reach_the_engine():
    engine = GatedEngine(tiny_qwen2())
    engine.gate.set()
    sampler = RolloutSampler(VLLMUpdater(engine=engine))
    with pytest.raises(TypeError, match="collate_fn=list"):
        sampler.generate(next(iter(DataLoader([[1, 2], [3, 4]], batch_size=2))))
    with pytest.raises(ValueError, match=r"token id 512, outside the engine's vocabulary \[0, 512\)"):
        sampler.generate([[1, 512]])
    with pytest.raises(TypeError, match="unexpected keyword argument.s. engine_idx; it takes engine_index, pad_token"):
        sampler.generate([[1, 2]], engine_idx=0)  # type: ignore[call-arg]  # (a typo is named, never ignored)
    assert engine.num_generates == 0
    assert sampler.generate([]) == []


class DeadEngine(FakeEngine):
    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

        raise VLLMEngineDeadError()


class EngineThatDiesWhileGenerating(GatedEngine):
    def is_dead(self) -> bool:
        return self.num_generates > 0


def test_an_engine_that_dies_during_a_generate_ends_it_early():
    engine = EngineThatDiesWhileGenerating(tiny_qwen2())
    sampler = RolloutSampler(VLLMUpdater(engine=engine), timeout_seconds=30)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="fake test engine has died"):
        sampler.generate([[1, 2]])
    assert time.monotonic() - start < 5
    engine.gate.set()  # let the abandoned call end


def test_an_engine_that_died_is_named():
    sampler = RolloutSampler(VLLMUpdater(engine=DeadEngine(tiny_qwen2())))
    with pytest.raises(EngineDeadError, match="fake test engine died while generating.*Restart it"):
        sampler.generate([[1, 2]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"generate_timeout_seconds": 0}, "timeout_seconds=0"), ({"max_staleness": -1}, "max_staleness=-1")],
)
def test_bad_rollout_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMWeightSync(**kwargs)


BAD_PROMPTS = {
    "a default-collated batch": (lambda: next(iter(DataLoader([[1, 2, 3], [4, 5, 6]], batch_size=2))), TypeError),
    "a float tensor": (lambda: torch.tensor([[1.0, 2.0]]), TypeError),
    "nested lists": (lambda: [[[1, 2], [3, 4]]], TypeError),
    "a token id outside the vocabulary": (lambda: [[1, 2, VOCAB_SIZE]], ValueError),
    "a prompt longer than max_model_len": (lambda: [[1] * MAX_MODEL_LEN], ValueError),
    "text for an engine without a tokenizer": (lambda: ["hello"], ValueError),
}


@pytest.mark.engine
@pytest.mark.parametrize("mistake", BAD_PROMPTS)
def test_a_prompt_mistake_is_refused_and_the_engine_keeps_serving(mistake, llm):
    prompts, error = BAD_PROMPTS[mistake]
    sync = VLLMWeightSync(engine=llm, generate_timeout_seconds=60)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    start = time.monotonic()
    with pytest.raises(error, match="Prompt|prompts"):
        sync.generate(prompts(), params)
    assert time.monotonic() - start < 5
    (generation,) = sync.generate([[1, 2, 3]], params)
    assert len(generation.token_ids) == 4


@pytest.mark.engine
def test_an_engine_core_killed_mid_run_is_named_in_time(model_dir):
    import os
    import signal

    from helpers import build_llm, shutdown

    doomed = build_llm(model_dir)
    try:
        sync = VLLMWeightSync(engine=doomed, generate_timeout_seconds=30)
        params = SamplingParams(max_tokens=4, temperature=0.0)
        sync.generate([[1, 2, 3]], params)
        os.kill(doomed.llm_engine.engine_core.resources.engine_manager.processes[0].pid, signal.SIGKILL)
        start = time.monotonic()
        # vLLM notices the exit but leaves a waiting generate blocked: the sampler asks while it waits.
        with pytest.raises(EngineDeadError, match="in-process vllm.LLM has died.*Restart it"):
            sync.generate([[1, 2, 3]], params)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):  # and at once for the next call
            sync.generate([[1, 2, 3]], params, timeout_seconds=1)
    finally:
        shutdown(doomed)


def test_pushes_that_failed_count_as_versions_the_engine_missed():
    sampler = RolloutSampler(VLLMUpdater(), max_staleness=1)
    versions = sampler.updater.versions
    versions.set_committed(3)
    sampler.record([2])  # one behind: allowed
    for _ in range(2):  # two push points sent nothing since version 3 landed
        with versions.push_point():
            pass
    assert versions.trainer == 5 and versions.take_staleness() == 3
    with pytest.raises(StaleRolloutsError, match="3 versions behind.*2 push point\\(s\\) since sent no weights"):
        sampler.record([2])


class PausedEngine(FakeEngine):
    """Refuses new requests as vLLM 0.33 does while a push holds generation paused ("wait"/"abort")."""

    def __init__(self, model, refusals: int, error: Exception) -> None:
        super().__init__(model)
        self.refusals, self.error, self.calls = refusals, error, 0

    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        self.calls += 1
        if self.calls <= self.refusals:
            raise self.error
        return super().generate(prompts, sampling_params)


def paused_refusals():
    from vllm.exceptions import RetryableRequestError

    from lightning_vllm.errors import EngineBusyError

    return [RetryableRequestError("Generation is paused."), EngineBusyError("HTTP 503 engine_paused")]


@pytest.mark.parametrize("error", paused_refusals(), ids=["in-process", "server"])
def test_a_request_refused_while_a_push_holds_generation_paused_is_asked_again(error):
    engine = PausedEngine(tiny_qwen2(), refusals=3, error=error)
    sampler = RolloutSampler(VLLMUpdater(engine=engine), timeout_seconds=10)
    generations = sampler.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert len(generations) == 1 and engine.calls == 4


def test_an_engine_that_stays_paused_ends_the_generate_at_its_timeout():
    engine = PausedEngine(tiny_qwen2(), refusals=10**6, error=paused_refusals()[0])
    sampler = RolloutSampler(VLLMUpdater(engine=engine), timeout_seconds=0.5)
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="generation stayed paused"):
        sampler.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert time.monotonic() - started < 2 and engine.calls > 2


def test_other_generate_errors_are_not_retried():
    engine = PausedEngine(tiny_qwen2(), refusals=1, error=ValueError("bad sampling params"))
    with pytest.raises(ValueError, match="bad sampling params"):
        RolloutSampler(VLLMUpdater(engine=engine)).generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert engine.calls == 1


class RecordsTimeouts(FakeEngine):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.timeouts: list[float | None] = []

    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        self.timeouts.append(timeout_seconds)
        return super().generate(prompts, sampling_params)


def test_the_engine_is_given_what_is_left_of_the_generate_timeout():
    engine = RecordsTimeouts(tiny_qwen2())
    sampler = RolloutSampler(VLLMUpdater(engine=engine), timeout_seconds=30)
    sampler.generate([[1, 2]])
    sampler.generate([[1, 2]], timeout_seconds=5)
    assert 29 < engine.timeouts[0] <= 30 and 4 < engine.timeouts[1] <= 5


def test_a_rollout_waits_for_the_end_of_what_a_failed_push_left_on_the_engine():
    from lightning_vllm._waits import BackgroundCall
    from lightning_vllm.core import after_failure

    engine = FakeEngine(tiny_qwen2())
    sampler = RolloutSampler(VLLMUpdater(engine=engine), timeout_seconds=5)
    cleanup_done = threading.Event()
    after_failure.started(engine, BackgroundCall(cleanup_done.wait, 10, what="closing the update a push left open"))
    threading.Timer(0.3, cleanup_done.set).start()
    started = time.monotonic()
    (generation,) = sampler.generate([[1, 2]])  # not on layers still mid-reload
    assert time.monotonic() - started >= 0.25 and generation.prompt_token_ids == [1, 2]
    frozen = threading.Event()
    after_failure.started(engine, BackgroundCall(frozen.wait, 10, what="a frozen engine's cleanup"))
    with pytest.raises(WeightSyncTimeoutError, match="has not ended the update a failed push left open"):
        sampler.generate([[1, 2]], timeout_seconds=0.3)
    frozen.set()
