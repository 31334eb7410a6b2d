"""The staging ring hands out regions in order and never one whose bytes are still being read."""

from __future__ import annotations

import pytest

from lightning_vllm.backends.gloo.staging import StagingRing


class FakeWork:
    """A broadcast that completes when the test says so (stands in for a gloo Work)."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_regions_follow_each_other_and_wrap_to_the_start():
    ring = StagingRing(100)
    works = [FakeWork() for _ in range(3)]

    def finish_oldest():
        next(work for work in works if not work.done).done = True

    regions = []
    for work in works:
        region, tensor = ring.take(40, make_room=finish_oldest)
        assert tensor.numel() == 40
        ring.hold(region, work)
        regions.append(region)
    # the third region does not fit after the second, so it wraps and had to wait for the first.
    assert regions == [(0, 40), (40, 80), (0, 40)]
    assert works[0].done and not works[1].done


def test_a_region_overlapping_bytes_in_flight_waits_for_them():
    ring = StagingRing(64)
    first = FakeWork()
    region, _ = ring.take(64, make_room=lambda: None)
    ring.hold(region, first)
    calls = []

    def make_room():
        calls.append(1)
        first.done = True

    assert ring.take(8, make_room)[0] == (0, 8)
    assert calls == [1]


def test_reset_starts_from_the_beginning_and_sizes_are_checked():
    ring = StagingRing(32)
    ring.take(16, make_room=lambda: None)
    ring.reset()
    assert ring.take(16, make_room=lambda: None)[0] == (0, 16)
    with pytest.raises(ValueError, match="Cannot stage 33 bytes"):
        ring.take(33, make_room=lambda: None)
    with pytest.raises(ValueError, match="must be > 0"):
        StagingRing(0)
