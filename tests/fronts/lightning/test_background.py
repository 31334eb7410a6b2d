"""Background pushes (``blocking=False``): versions, skipped push points, staleness, errors and
clean shutdown, with a real Trainer and a fake engine that holds an update until told (engine-free);
then the weights a real vLLM engine serves once a background push has landed."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import (
    CallsAtBatch,
    FakeEngine,
    RolloutCausalLM,
    TinyCausalLM,
    assert_serves,
    cpu_trainer,
    served_version,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
)
from lightning.pytorch.callbacks import Callback

from lightning_vllm import VLLMWeightSync, WeightSyncError, WeightSyncTimeoutError, generate
from lightning_vllm.core.weight_sync import WeightSync
from lightning_vllm.fronts.lightning.background import BackgroundPusher
from lightning_vllm.options import UpdaterOptions

GATE_SECONDS = 20  # the longest a gated fake waits for its gate (the test is broken if it does)


class GatedEngine(FakeEngine):
    """A fake engine whose ``finish_weight_update`` waits until ``gate`` is set: a push stays in
    flight for as long as a test wants. It keeps what an update leaves out, as vLLM does, and
    records the names each update carried. ``fail_next`` makes the next finish fail, as a server
    that went away does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False
        self.received_names: list[list[str]] = []

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        assert self.gate.wait(GATE_SECONDS), "the test never opened the gate"
        if self.fail_next:
            self.fail_next = False
            raise WeightSyncError("The vLLM server went away (test)")
        before, received = self.weights, self._pending
        self.received_names.append(sorted(received))
        super().finish_weight_update(weight_version)
        self.weights = {**before, **received}


class OpensTheGateAtTrainEnd(Callback):
    """Placed before the sync callback: the push in flight at the end of fit may land."""

    def __init__(self, engine: GatedEngine) -> None:
        self.engine = engine

    def on_train_end(self, trainer, pl_module) -> None:
        self.engine.gate.set()


def lightning_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("lightning-vllm: weight")]


def scalars(trainer, tag: str) -> list[tuple[int, float]]:
    return tensorboard_scalars(trainer.logger.log_dir, tag)


# -- the pusher alone -----------------------------------------------------------------


def test_bad_when_busy_is_named():
    with pytest.raises(ValueError, match="when_busy='later'"):
        BackgroundPusher(WeightSync(), when_busy="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="when_busy='later'"):
        VLLMWeightSync(blocking=False, when_busy="later")  # type: ignore[arg-type]


def test_a_push_in_flight_commits_its_version_when_the_engine_finishes():
    model = tiny_qwen2(seed=0)
    engine = GatedEngine(model)
    pusher = BackgroundPusher(WeightSync(engine, options=UpdaterOptions(timeout_seconds=10)))
    engine.gate.clear()
    submitted = pusher.submit(model)
    assert submitted.started and submitted.version == 1 and pusher.updater.versions.in_flight == 1
    with torch.no_grad():  # training goes on: the push sends the weights of its push point
        for param in model.parameters():
            param.add_(1.0)
    assert pusher.updater.weight_version == 0 and pusher.collect() is None  # not landed yet
    assert not pusher.submit(model).started and pusher.updater.versions.skipped == 1  # one push at a time
    engine.gate.set()
    assert pusher.wait(10)
    stats = pusher.collect()
    assert stats is not None and stats.weight_version == 1 and engine.version == "1"
    assert pusher.updater.weight_version == 1 and pusher.updater.versions.in_flight is None
    assert not engine.holds(model)  # the snapshot, not the weights written after it
    assert pusher.submit(model).started and pusher.wait(10) and pusher.collect() is not None
    assert engine.holds(model) and engine.version == "2"
    pusher.close()
    pusher.updater.close()


# -- with a Trainer -------------------------------------------------------------------


class RecordsVersions(CallsAtBatch):
    """Calls ``calls[batch_idx]()`` then samples from the fake engine, recording each sample's
    version and the staleness the sampler counts."""

    def __init__(self, calls: dict) -> None:
        super().__init__(calls, lr=1e-3)
        self.versions: list[str | None] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.versions += [rollout.weight_version for rollout in generate(self, [[1, 2, 3]])]
        return loss


def test_a_push_point_that_finds_a_push_in_flight_is_skipped_and_fit_ends_on_the_last_weights(tmp_path):
    engine = GatedEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, blocking=False, timeout_seconds=10)

    def land() -> None:  # the push in flight lands, and this step waits until it has
        engine.gate.set()
        assert sync.pusher is not None and sync.pusher.wait(10)

    def land_then_hold() -> None:
        land()
        engine.gate.clear()

    # Fit start: v1 (blocking). Step 1's push (v2) stays in flight through step 2, whose push point
    # is skipped; it lands in step 3, whose push (v3) lands in step 4. Step 4's push (v4) is in
    # flight at step 5's push point (skipped) and lands at the end of fit, which then sends step 5's
    # weights (v5).
    module = RecordsVersions({0: engine.gate.clear, 2: land, 3: land_then_hold})
    trainer = cpu_trainer(tmp_path, [OpensTheGateAtTrainEnd(engine), sync], max_steps=5)
    trainer.fit(module, token_batches(num_batches=5))

    assert [value for _, value in scalars(trainer, "vllm/weight_version")] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert scalars(trainer, "vllm/sync_skipped") == [(2, 1.0), (5, 2.0)]
    assert engine.holds(module.hf) and engine.version == "5" and sync.weight_version == 5
    assert not sync.push_in_flight and not lightning_threads()
    # Rollouts during a push in flight came from the last committed version, and count as stale:
    # at step 1's end the trainer was at v2 (in flight) and the rollout at v1.
    assert module.versions == [1, 1, 2, 3, 3]
    assert (2, 1.0) in scalars(trainer, "vllm/staleness")
    assert len(scalars(trainer, "vllm/sync_stall_seconds")) == 7  # fit start, 5 push points, the final push


def test_with_when_busy_wait_every_push_point_gets_a_version(tmp_path):
    engine = GatedEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, blocking=False, when_busy="wait", timeout_seconds=10)

    def hold_for_a_while() -> None:  # the push point of this step waits for the push in flight
        engine.gate.clear()
        threading.Timer(0.3, engine.gate.set).start()

    module = CallsAtBatch({1: hold_for_a_while, 2: hold_for_a_while}, lr=1e-3)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
    trainer.fit(module, token_batches(num_batches=4))
    assert sync.weight_version == 5 and engine.version == "5"  # fit start + 4 steps, none skipped
    assert sync.pusher is not None and sync.updater.versions.skipped == 0
    assert [value for _, value in scalars(trainer, "vllm/weight_version")] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert engine.holds(module.hf) and not lightning_threads()


def test_a_failed_background_push_raises_at_the_next_push_point(tmp_path):
    engine = GatedEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, blocking=False, timeout_seconds=10)

    def fail_next() -> None:  # once step 1's push has landed: step 2's fails
        assert sync.pusher is not None and sync.pusher.wait(10)
        engine.fail_next = True

    module = CallsAtBatch({1: fail_next}, lr=1e-3)
    with pytest.raises(WeightSyncError, match="went away"):
        cpu_trainer(tmp_path, [sync], max_steps=4).fit(module, token_batches(num_batches=4))
    assert engine.version == "2" and not lightning_threads()


def test_with_warn_a_failed_background_push_is_counted_and_the_next_one_lands(tmp_path):
    engine = GatedEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(
        engine=engine, every_n_train_steps=1, blocking=False, when_busy="wait", timeout_seconds=10, on_sync_error="warn"
    )

    def fail_next() -> None:  # once step 1's push has landed: step 2's fails
        assert sync.pusher is not None and sync.pusher.wait(10)
        engine.fail_next = True

    module = CallsAtBatch({1: fail_next}, lr=1e-3)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
    with pytest.warns(UserWarning, match="went away.*Failed pushes so far: 1"):
        trainer.fit(module, token_batches(num_batches=4))
    assert sync.sync_failures == 1 and len(scalars(trainer, "vllm/sync_failures")) == 1
    assert engine.holds(module.hf) and engine.version == str(sync.weight_version)
    assert sync.updater.versions.missed == 0 and not lightning_threads()


def test_a_frozen_engine_at_the_end_of_fit_is_an_error_not_a_hang(tmp_path):
    engine = GatedEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, blocking=False, timeout_seconds=1)

    def freeze() -> None:  # once step 1's push has landed, the engine stops finishing updates
        assert sync.pusher is not None and sync.pusher.wait(10)
        engine.gate.clear()

    module = CallsAtBatch({1: freeze}, lr=1e-3)
    try:
        # Whichever gives up first after 1 s: the push's own call, or the end of fit waiting for it.
        with pytest.raises(WeightSyncTimeoutError, match="still on its way|Timed out"):
            cpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))
    finally:
        engine.gate.set()  # (lets the fake's own thread go)
    assert engine.version == "2"  # fit start and step 1; step 2's push never committed


def test_an_exception_in_training_ends_the_push_in_flight_cleanly(tmp_path):
    engine = GatedEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, blocking=False, timeout_seconds=10)

    def crash() -> None:
        threading.Timer(0.3, engine.gate.set).start()  # the push in flight lands during teardown
        raise RuntimeError("a bug in training_step")

    # Closed before step 1's push goes (version 2), which then stays in flight: step 2's push point is skipped, and
    # step 3's training_step raises. (Closed a step later, version 2 could land first, and version 3 be the one.)
    module = CallsAtBatch({0: engine.gate.clear, 2: crash}, lr=1e-3)
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        cpu_trainer(tmp_path, [sync], max_steps=4).fit(module, token_batches(num_batches=4))
    assert engine.version == "2" and engine.receiver is None  # landed, then the group was released
    assert not lightning_threads()


def test_frozen_parameters_are_not_sent_again(tmp_path):
    hf = tiny_qwen2(seed=0)
    hf.model.embed_tokens.weight.requires_grad_(False)
    engine = GatedEngine(hf)
    module = TinyCausalLM(hf, lr=1e-3)
    for blocking in (True, False):
        sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, blocking=blocking)
        engine.received_names.clear()
        trainer = cpu_trainer(tmp_path / str(blocking), [sync], max_steps=2)
        trainer.fit(module, token_batches(num_batches=2))
        first, *later = engine.received_names
        assert "model.embed_tokens.weight" in first  # a new connection sends everything once
        assert later and all("model.embed_tokens.weight" not in names for names in later)
        assert all("model.layers.0.self_attn.q_proj.weight" in names for names in later)
        full, *partial = [value for _, value in scalars(trainer, "vllm/sync_bytes")]
        embedding_bytes = hf.model.embed_tokens.weight.numel() * 4
        assert all(value == full - embedding_bytes for value in partial)
        assert engine.holds(hf)


# -- with a real vLLM engine ----------------------------------------------------------


class DirectRollouts(RolloutCausalLM):
    """Also calls ``llm.generate`` itself in every step, as many users do, while a push is in flight."""

    def __init__(self, model: torch.nn.Module, llm) -> None:
        super().__init__(model, lr=1e-2)
        self.llm = llm

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams, TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2))
        assert len(outputs[0].outputs[0].token_ids) == 2
        return super().training_step(batch, batch_idx)


@pytest.mark.engine
def test_vllm_serves_the_trained_weights_once_the_background_push_lands(llm, tmp_path):
    start = served_version(llm)
    module = DirectRollouts(tiny_qwen2(seed=49), llm)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1, blocking=False, when_busy="wait")
    trainer = cpu_trainer(tmp_path, [sync], max_steps=3)
    trainer.fit(module, token_batches(num_batches=3))
    # Fit start, then one push per step, none skipped ("wait"); the last one landed before fit ended.
    assert sync.weight_version == start + 4 == served_version(llm)
    assert [value for _, value in scalars(trainer, "vllm/weight_version")] == [float(start + i) for i in range(1, 5)]
    assert_serves(llm, module.hf)
    # Every rollout came from a committed version, at most the one pushed before its step.
    versions = [version for step in module.seen for version in step[4]]  # (step, prompts, ..., versions, trainer)
    assert versions == sorted(versions) and start + 1 <= versions[0] and versions[-1] <= start + 3
    assert not lightning_threads()
