"""WeightSync, the core, without a framework: its options are stored once, and a push is prepared, then
sent (against the fake engine; the engine tier drives real ones)."""

from __future__ import annotations

import pytest
from helpers import FakeEngine, tiny_qwen2

from lightning_vllm import SyncStats, VLLMUpdater, WeightSync
from lightning_vllm.options import UpdaterOptions


def test_options_are_stored_once_and_changed_only_through_set_options():
    model = tiny_qwen2(seed=5)
    engine = FakeEngine(model)
    sync = WeightSync(engine, options=UpdaterOptions(timeout_seconds=30.0))
    sync.push(model)
    assert sync.initialized
    with pytest.raises(AttributeError, match=r"call set_options\(timeout_seconds=\.\.\.\)"):
        sync.timeout_seconds = 5.0  # type: ignore[attr-defined]  # would be a stray attribute no push reads
    with pytest.raises(ValueError, match="timeout_seconds=-1"):
        sync.set_options(timeout_seconds=-1)
    with pytest.raises(ValueError, match="Not an option: timeout. The options are"):
        sync.set_options(timeout=5.0)
    assert sync.options.timeout_seconds == 30.0 and sync.initialized  # a refused change changes nothing
    sync.set_options(timeout_seconds=5.0, changed_only=False)
    assert sync.options == UpdaterOptions(timeout_seconds=5.0, changed_only=False) and not sync.initialized
    assert sync.push(model).weight_version == 2 and engine.version == "2"  # joined again, with the new options
    with pytest.raises(AttributeError, match="master_port is one of the options"):
        VLLMUpdater().master_port = 1  # type: ignore[misc]  # TorchRL's names read the same options


def test_a_push_is_prepared_then_sent_and_only_its_send_moves_the_version():
    model = tiny_qwen2(seed=6)
    engine = FakeEngine(model)
    sync = WeightSync(engine)
    push = sync.prepare(model)  # every check, the group joined: nothing sent
    assert push.engine_indices == [0] and engine.num_updates == 0 and sync.weight_version == 0
    with sync.versions.push_point() as point:
        stats = sync.send(push, point.begin())
    assert stats.weight_version == sync.weight_version == 1 and engine.holds(model)


def test_a_push_reports_its_rate_over_the_seconds_spent_moving_the_bytes():
    model = tiny_qwen2(seed=7)
    stats = WeightSync(FakeEngine(model)).push(model)
    timing = stats.timing
    assert stats.num_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert 0 < timing.transfer_seconds and timing.transfer_seconds + timing.commit_seconds <= stats.seconds
    assert stats.gb_per_second == pytest.approx(stats.num_bytes / timing.transfer_seconds / 1e9)
    assert SyncStats(1, 0.5, 0).gb_per_second == 0.0  # nothing moved (every group unchanged)
