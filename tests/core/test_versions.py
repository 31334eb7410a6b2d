"""The trainer's weight versions: committed, in flight, missed, and the trainer's position."""

from __future__ import annotations

import pickle

import pytest

from lightning_vllm.core.versions import WeightVersions


def play(events: str) -> WeightVersions:
    """``b``: a push begins, ``c``: it commits, ``a``: it lands nowhere, ``s``: a push point is skipped."""
    versions = WeightVersions()
    version = 0
    for event in events:
        if event == "b":
            version = versions.begin()
        elif event == "c":
            versions.commit(version)
        elif event == "a":
            versions.abandon(version)
        elif event == "s":
            versions.skip()
    return versions


@pytest.mark.parametrize(
    ("events", "committed", "in_flight", "trainer"),
    [
        ("", 0, None, 0),
        ("bc", 1, None, 1),
        ("bcbc", 2, None, 2),
        ("b", 0, 1, 1),  # on its way: the trainer is there already
        ("bs", 0, 1, 2),  # a push point skipped while one is on its way
        ("bsc", 1, None, 2),  # it lands: the skipped push point still counts
        ("bsa", 0, None, 2),  # it fails: both push points are missed
        ("bcbaba", 1, None, 3),  # two failed pushes in a row after version 1
        ("bcbabab", 1, 2, 4),  # then one on its way: version 1 stays 3 push points behind until it lands
        ("bcbababc", 2, None, 2),  # and lands: nothing missed any more
        ("bcss", 1, None, 3),
        ("bcssbc", 2, None, 2),
    ],
)
def test_the_trainer_counts_every_push_point(events, committed, in_flight, trainer):
    versions = play(events)
    assert (versions.committed, versions.in_flight, versions.trainer) == (committed, in_flight, trainer)
    assert versions.staleness(oldest=versions.committed) == trainer - committed


def test_one_push_at_a_time():
    versions = play("b")
    with pytest.raises(RuntimeError, match="Weight version 1 is still on its way"):
        versions.begin()


def test_another_rank_adopts_rank_zeros_versions_and_a_spawned_copy_works():
    rank_zero, other = play("bcbsa"), WeightVersions()
    other.adopt(rank_zero.as_ints())
    assert (other.committed, other.in_flight, other.missed, other.trainer) == (1, None, 2, 3)
    copy = pickle.loads(pickle.dumps(rank_zero))
    assert copy.as_ints() == rank_zero.as_ints() and copy.begin() == 2


def test_an_engine_further_on_moves_the_count_and_a_negative_version_is_refused():
    versions = play("bc")
    versions.follow(7)
    assert versions.begin() == 8
    with pytest.raises(ValueError, match="weight_version=-1"):
        WeightVersions().set_committed(-1)
