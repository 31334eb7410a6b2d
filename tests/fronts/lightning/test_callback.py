"""The Lightning callback: when it pushes (without a Trainer, then with one and a fake engine),
and end to end with a real Trainer and a real vLLM engine."""

from __future__ import annotations

import copy

import pytest
from helpers import (
    CallsAtBatch,
    FakeEngine,
    TinyCausalLM,
    assert_serves,
    cpu_trainer,
    hf_prompt_logprobs,
    max_abs_diff,
    served_version,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
    vllm_prompt_logprobs,
)

from lightning_vllm import EngineConfigError, VLLMWeightSync, WeightSyncError, WeightSyncTimeoutError
from lightning_vllm.fronts.lightning.callback import PushSchedule

# -- the decision alone ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("every", "global_step", "last_pushed", "due"),
    [
        (2, 2, -1, True),
        (2, 3, 2, False),  # not a multiple
        (2, 4, 2, True),
        (2, 4, 4, False),  # the same optimizer step, next accumulated batch
        (2, 0, -1, False),  # no optimizer step yet
        (1, 1, 0, True),
        (0, 4, -1, False),  # off
    ],
)
def test_a_push_is_due_once_per_nth_optimizer_step(every, global_step, last_pushed, due):
    assert PushSchedule(every_n_train_steps=every).due_after_batch(global_step, last_pushed) is due


@pytest.mark.parametrize(
    ("every", "epochs_done", "global_step", "last_pushed", "due"),
    [
        (1, 1, 10, 8, True),
        (2, 1, 10, 8, False),
        (2, 2, 20, 18, True),
        (1, 1, 10, 10, False),  # the step-based schedule pushed this step already
        (0, 3, 30, 0, False),  # off
    ],
)
def test_a_push_is_due_every_nth_epoch_unless_the_step_was_pushed(every, epochs_done, global_step, last_pushed, due):
    schedule = PushSchedule(every_n_epochs=every)
    assert schedule.due_after_epoch(epochs_done, global_step, last_pushed) is due


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_train_steps": -1}, "every_n_train_steps=-1"),
        ({"every_n_epochs": -2}, "every_n_epochs=-2"),
        ({"backend": "tcp"}, "backend='tcp'"),
        ({"timeout_seconds": 0}, "timeout_seconds=0"),
        ({"max_staleness": -1}, "max_staleness=-1"),
        ({"on_sync_error": "ignore"}, "on_sync_error='ignore'"),
        ({"engine": "http://127.0.0.1:1", "updater": object()}, "either engine=... or updater=..."),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMWeightSync(**kwargs)


def test_none_and_zero_turn_intervals_off():
    assert VLLMWeightSync(every_n_train_steps=None).schedule == PushSchedule(0, 0)
    assert VLLMWeightSync(every_n_train_steps=0, every_n_epochs=3).schedule == PushSchedule(0, 3)


def test_state_dict_round_trip_reads_old_checkpoints():
    sync = VLLMWeightSync()
    sync.load_state_dict({})  # a checkpoint written before these keys existed
    assert sync.weight_version == 0
    sync.load_state_dict({"weight_version": 7, "last_global_step_pushed": 14})
    assert sync.state_dict() == {"weight_version": 7, "last_global_step_pushed": 14}


# -- with a Trainer and a fake engine -------------------------------------------------


class FlakyEngine(FakeEngine):
    """A fake engine that is unreachable while ``down`` (as a restarting server is)."""

    down = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if self.down:
            raise WeightSyncError("Cannot reach the vLLM server (test: it is restarting)")
        super().init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        if self.down:
            raise WeightSyncTimeoutError("The vLLM server did not answer (test: it is restarting)")
        super().start_weight_update()


def goes_down_at_step_2(engine: FlakyEngine) -> CallsAtBatch:
    """A module that takes the engine down before the push of step 2 and brings it back before step 4's."""

    def set_down(down: bool) -> None:
        engine.down = down

    return CallsAtBatch({1: lambda: set_down(True), 3: lambda: set_down(False)}, lr=1e-3)


def test_with_warn_failed_pushes_are_counted_and_the_next_push_point_reconnects(tmp_path):
    engine = FlakyEngine(tiny_qwen2(seed=0))
    module = goes_down_at_step_2(engine)
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, timeout_seconds=5, on_sync_error="warn")
    trainer = cpu_trainer(tmp_path, [sync], max_steps=5)

    with pytest.warns(UserWarning, match="Pushing weights to vLLM failed.*Failed pushes so far: 2"):
        trainer.fit(module, token_batches(num_batches=5))

    assert tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_failures") == [(2, 1.0), (3, 2.0)]
    assert pushed_steps(trainer) == [0, 1, 4, 5]  # fit start, step 1, then again once the engine is back
    assert sync.weight_version == 4 and engine.version == "4" and engine.holds(module.hf)
    assert sync.updater.versions.missed == 0  # the last push landed


def test_by_default_a_failed_push_ends_training(tmp_path):
    engine = FlakyEngine(tiny_qwen2(seed=0))
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1, timeout_seconds=5)
    with pytest.raises(WeightSyncTimeoutError, match="restarting"):
        cpu_trainer(tmp_path, [sync], max_steps=5).fit(goes_down_at_step_2(engine), token_batches(num_batches=5))
    assert sync.weight_version == 2


def test_with_warn_a_misconfigured_engine_still_ends_training(tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    engine = FakeEngine(tiny_qwen2(seed=0, tie_word_embeddings=False))
    engine.transfer_backend = lambda: "nccl"
    sync = VLLMWeightSync(engine=engine, backend="gloo", timeout_seconds=5, on_sync_error="warn")
    with pytest.raises(EngineConfigError, match="expects weight-transfer backend 'nccl'"):
        cpu_trainer(tmp_path, [sync], max_steps=1).fit(module, token_batches(num_batches=1))


def pushed_steps(trainer) -> list[int]:
    return [step for step, _ in tensorboard_scalars(trainer.logger.log_dir, "vllm/weight_version")]


def test_pushes_follow_optimizer_steps_under_gradient_accumulation(tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    engine = FakeEngine(module.hf)
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=2, push_on_fit_start=False)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4, accumulate_grad_batches=3)

    trainer.fit(module, token_batches(num_batches=12))

    # 12 batches, 4 optimizer steps: pushes at steps 2 and 4 only, once each.
    assert sync.weight_version == 2 and engine.num_updates == 2
    assert pushed_steps(trainer) == [2, 4]
    assert engine.holds(module.hf) and engine.version == "2"


def test_epoch_pushes_do_not_repeat_a_step_push(tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    engine = FakeEngine(module.hf)
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=2, every_n_epochs=1, push_on_fit_start=False)
    trainer = cpu_trainer(tmp_path, [sync], max_epochs=2)

    trainer.fit(module, token_batches(num_batches=3))

    # Steps 2 and 4 by the step schedule; the ends of epoch 1 (step 3) and epoch 2
    # (step 6) by the epoch schedule, of which step 6 was also a step push: once.
    assert pushed_steps(trainer) == [2, 3, 4, 6]
    assert engine.num_updates == 4 and engine.holds(module.hf)


def test_only_epochs(tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    sync = VLLMWeightSync(engine=FakeEngine(module.hf), every_n_train_steps=None, every_n_epochs=2)
    trainer = cpu_trainer(tmp_path, [sync], max_epochs=4)
    trainer.fit(module, token_batches(num_batches=2))
    assert pushed_steps(trainer) == [0, 4, 8]  # fit start, then the ends of epochs 2 and 4


def test_a_resumed_run_continues_counting_versions(tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    engine = FakeEngine(module.hf)
    first = VLLMWeightSync(engine=engine, every_n_train_steps=2)
    trainer = cpu_trainer(tmp_path, [first], max_steps=2)
    trainer.fit(module, token_batches(num_batches=4))
    checkpoint = tmp_path / "run.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert first.weight_version == 2

    resumed = VLLMWeightSync(engine=engine, every_n_train_steps=2)
    trainer = cpu_trainer(tmp_path, [resumed], max_steps=4)
    trainer.fit(copy.deepcopy(module), token_batches(num_batches=4), ckpt_path=checkpoint)

    # Restored version 2, then a push at fit start (3) and at step 4 (4), not again at step 2.
    assert resumed.weight_version == 4 and engine.version == "4"


def test_the_hf_model_can_live_under_any_attribute(tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=3), attribute="policy")
    engine = FakeEngine(module.hf)
    cpu_trainer(tmp_path, [VLLMWeightSync(engine=engine)], max_steps=1).fit(module, token_batches(num_batches=1))
    assert engine.holds(module.hf)


def test_rank_zero_without_an_engine_fails_at_setup(tmp_path):
    sync = VLLMWeightSync(engine=None)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=1)
    with pytest.raises(ValueError, match="no vLLM engine"):
        trainer.fit(TinyCausalLM(tiny_qwen2()), token_batches(num_batches=1))


class FailingCausalLM(TinyCausalLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_training_releases_the_group(tmp_path):
    module = FailingCausalLM(tiny_qwen2(seed=0))
    engine = FakeEngine(module.hf)
    sync = VLLMWeightSync(engine=engine, every_n_train_steps=1)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=4)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, token_batches(num_batches=4))
    assert sync.weight_version == 2  # fit start and step 1
    assert not sync.updater.initialized and engine.receiver is None


# -- with a real vLLM engine ----------------------------------------------------------


@pytest.mark.engine
def test_training_run_keeps_vllm_on_the_trained_weights(llm, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    served_before, v = vllm_prompt_logprobs(llm), served_version(llm)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=60, verify_pushes=True)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=6)

    trainer.fit(module, token_batches(num_batches=6))

    # The test can fail: training moved the weights away from what vLLM served before.
    module.hf.eval()
    assert max_abs_diff(served_before, hf_prompt_logprobs(module.hf)) > 1e-2
    assert_serves(llm, module.hf)
    # Fit start, then steps 2, 4 and 6, counting on from what the shared engine served.
    assert sync.weight_version == v + 4
    assert llm.get_weight_version() == str(v + 4)
    logged = tensorboard_scalars(trainer.logger.log_dir, "vllm/weight_version")
    assert logged == [(0, v + 1.0), (2, v + 2.0), (4, v + 3.0), (6, v + 4.0)]
    sync_seconds = tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_seconds")
    sync_bytes = tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_bytes")
    assert len(sync_seconds) == 4 and all(seconds > 0 for _, seconds in sync_seconds)
    num_bytes = sum(p.numel() * p.element_size() for p in module.hf.parameters())
    assert [value for _, value in sync_bytes] == [float(num_bytes)] * 4
    # Where each push's seconds went: moving the bytes, the commit (gloo loads there), generation paused
    # (around the commit only on gloo), and the rate over the transfer.
    timing = {
        name: [value for _, value in tensorboard_scalars(trainer.logger.log_dir, f"vllm/sync_{name}")]
        for name in ("transfer_seconds", "commit_seconds", "pause_seconds", "check_seconds", "gb_per_second")
    }
    for push, (_, seconds) in enumerate(sync_seconds):
        transfer, commit, pause = (
            timing[name][push] for name in ("transfer_seconds", "commit_seconds", "pause_seconds")
        )
        assert 0 < transfer and 0 < commit <= pause < seconds and transfer + commit <= seconds
        # and the check after the push (the shared engine has the worker extension), within the push's seconds
        assert 0 < timing["check_seconds"][push] < seconds - transfer - commit
        assert timing["gb_per_second"][push] == pytest.approx(num_bytes / transfer / 1e9, rel=1e-3)


@pytest.mark.parametrize("shown", [True, False])
def test_the_version_and_the_last_pushs_seconds_are_on_the_progress_bar_unless_hidden(shown, tmp_path):
    module = TinyCausalLM(tiny_qwen2(seed=0), lr=1e-3)
    sync = VLLMWeightSync(engine=FakeEngine(module.hf), every_n_train_steps=2, progress_bar=shown)
    trainer = cpu_trainer(tmp_path, [sync], max_steps=3)
    trainer.fit(module, token_batches(num_batches=3))
    bar = trainer.progress_bar_metrics
    if shown:
        assert bar["vllm/weight_version"] == 2.0  # fit start and step 2
        assert bar["vllm/sync_seconds"] == pytest.approx(sync.updater.last_sync.seconds)
    else:
        assert not any(name.startswith("vllm/") for name in bar)
    assert pushed_steps(trainer) == [0, 2]  # the loggers get them either way
