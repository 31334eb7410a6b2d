"""Every argument of the callback and the updater, checked together by one pure function."""

from __future__ import annotations

import pytest
from helpers import FakeEngine, tiny_qwen2

from lightning_vllm import VLLMUpdater, VLLMWeightSync
from lightning_vllm.options import SyncOptions, UpdaterOptions, check_options, check_updater_options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # updater= holds its own settings: any other updater setting would be ignored.
        (
            SyncOptions(updater_given=True, updater=UpdaterOptions(timeout_seconds=5)),
            "timeout_seconds would be ignored",
        ),
        (
            SyncOptions(updater_given=True, updater=UpdaterOptions(master_port=29600, lora="merged")),
            "master_port, lora would be ignored",
        ),
        (SyncOptions(updater_given=True, engine_given=True), "either engine=... or updater=..., not both"),
        # when_busy is checked whatever blocking says, and means nothing without blocking=False.
        (SyncOptions(when_busy="later"), "when_busy='later'"),
        (SyncOptions(blocking=False, when_busy="later"), "when_busy='later'"),
        # A background push leaves rollouts one version behind while it is on its way.
        (SyncOptions(blocking=False, max_staleness=0), "blocking=False cannot hold max_staleness=0"),
        # A fixed master_port takes one port per engine.
        (SyncOptions(num_engines=3, updater=UpdaterOptions(master_port=65534)), "with 3 engines.*at most 65533"),
        (SyncOptions(updater=UpdaterOptions(master_port=70000)), "master_port=70000"),
        (SyncOptions(every_n_train_steps=-1), "every_n_train_steps=-1"),
        (SyncOptions(every_n_epochs=-2), "every_n_epochs=-2"),
        (SyncOptions(max_staleness=-1), "max_staleness=-1"),
        (SyncOptions(generate_timeout_seconds=0), "generate_timeout_seconds=0"),
        (SyncOptions(on_sync_error="ignore"), "on_sync_error='ignore'"),
        (SyncOptions(updater=UpdaterOptions(timeout_seconds=-1)), "timeout_seconds=-1"),
        (SyncOptions(updater=UpdaterOptions(bucket_size_bytes=10)), "bucket_size_bytes=10"),
        (SyncOptions(updater=UpdaterOptions(pause_mode="drop")), "pause_mode='drop'"),  # type: ignore[arg-type]
        (SyncOptions(updater=UpdaterOptions(lora="both")), "lora='both'"),  # type: ignore[arg-type]
        (SyncOptions(updater=UpdaterOptions(vllm_tp_size=0)), "vllm_tp_size=0"),
        (SyncOptions(push_from="rank1"), "push_from='rank1'"),
        # vLLM's level 0 pauses scheduling and frees nothing: 0 must not read as "off".
        (SyncOptions(updater=UpdaterOptions(sleep_level=0)), r"sleep_level=0: vLLM's level 0 only pauses.*or None"),  # type: ignore[arg-type]
        (SyncOptions(updater=UpdaterOptions(sleep_level=3)), "sleep_level=3. Must be 1, 2 or None"),  # type: ignore[arg-type]
        (SyncOptions(updater=UpdaterOptions(sleep_level=True)), "sleep_level=True"),  # type: ignore[arg-type]
    ],
)
def test_conflicting_or_out_of_range_options_are_refused_with_both_named(options, message):
    with pytest.raises(ValueError, match=message):
        check_options(options)


@pytest.mark.parametrize(
    "options",
    [
        SyncOptions(),
        SyncOptions(updater_given=True),  # a ready updater, the rest at the defaults
        SyncOptions(blocking=False, when_busy="wait", max_staleness=1),
        SyncOptions(blocking=False, max_staleness=None),
        SyncOptions(num_engines=3, updater=UpdaterOptions(master_port=65533)),  # 65533, 65534, 65535
        SyncOptions(num_engines=0, updater=UpdaterOptions(master_port=0)),  # 0: any free port
        SyncOptions(every_n_train_steps=0, every_n_epochs=1, on_sync_error="warn"),
        SyncOptions(push_from="every_rank", updater=UpdaterOptions(backend="gloo")),
    ],
)
def test_options_that_fit_together_are_accepted(options):
    assert check_options(options) == []


def test_an_option_another_makes_meaningless_is_named_for_a_warning():
    (note,) = check_options(SyncOptions(when_busy="wait"))
    assert "when_busy='wait' is ignored" in note and "blocking=False" in note
    with pytest.warns(UserWarning, match="when_busy='wait' is ignored"):
        VLLMWeightSync(engine=FakeEngine(tiny_qwen2()), when_busy="wait")


def test_the_callback_and_the_updater_check_their_arguments_with_it():
    engine = FakeEngine(tiny_qwen2())
    with pytest.raises(ValueError, match="bucket_size_bytes would be ignored"):
        VLLMWeightSync(updater=VLLMUpdater(engine=engine), bucket_size_bytes=1024)
    with pytest.raises(ValueError, match="blocking=False cannot hold max_staleness=0"):
        VLLMWeightSync(engine=engine, blocking=False, max_staleness=0)
    with pytest.raises(ValueError, match="with 2 engines"):
        VLLMWeightSync(engine=[engine, FakeEngine(tiny_qwen2())], master_port=65535)
    with pytest.raises(ValueError, match="with 2 engines"):
        VLLMUpdater(engine=[engine, engine], master_port=65535)
    updater = VLLMUpdater(master_port=65535)
    with pytest.raises(ValueError, match="with 2 engines"):
        updater.set_engine([engine, engine])
    check_updater_options(updater.options, num_engines=1)


def test_the_callback_takes_the_updaters_prefix_cache_and_tensor_parallel_settings():
    sync = VLLMWeightSync(engine=FakeEngine(tiny_qwen2(seed=0)), reset_prefix_cache=False, vllm_tp_size=1)
    assert sync.updater.options.reset_prefix_cache is False and sync.updater.options.vllm_tp_size == 1
