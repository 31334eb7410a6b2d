"""The trainer's weight versions: committed, in flight, missed, and the trainer's position."""

from __future__ import annotations

import pickle

import pytest

from lightning_vllm.core.versions import VersionState, WeightVersions


def play(events: str) -> WeightVersions:
    """``b``: a push begins (its own thread ends it), ``c``: it commits, ``a``: it lands nowhere,
    ``s``: a push point is skipped."""
    versions = WeightVersions()
    push = None
    for event in events:
        if event == "b":
            with versions.push_point() as point:
                push = point.begin(hand_off=True)
        elif event == "c":
            push.commit()
        elif event == "a":
            push.abandon()
        elif event == "s":
            with versions.push_point():
                pass
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


def test_skipped_push_points_are_counted_once_here_and_unsent_until_a_push_begins():
    versions = play("bcss")
    assert (versions.skipped, versions.unsent, versions.missed) == (2, 2, 2)
    versions = play("bcssb")  # a push began: it carries their weights
    assert (versions.skipped, versions.unsent) == (2, 0)
    adopted = WeightVersions()
    with adopted.push_point() as point:
        point.adopt(VersionState.from_ints(play("bcs").state().to_ints()))  # another rank's, over a broadcast
    assert (adopted.skipped, adopted.unsent, adopted.trainer) == (1, 1, 2)


def test_one_push_at_a_time():
    versions = play("b")
    with pytest.raises(RuntimeError, match="Weight version 1 is still on its way"), versions.push_point() as point:
        point.begin()


def test_a_push_point_skips_abandons_or_leaves_what_it_handed_off_on_exit():
    versions = WeightVersions()
    with pytest.raises(ValueError), versions.push_point():
        raise ValueError("the weights could not be read")  # nothing began: failed, missed
    assert (versions.committed, versions.missed, versions.skipped) == (0, 1, 0)
    with pytest.raises(ValueError), versions.push_point() as point:
        point.begin()
        raise ValueError("the send failed")  # began, never committed: abandoned
    assert (versions.committed, versions.in_flight, versions.missed) == (0, None, 2)
    with versions.push_point() as point:
        point.begin().commit()
    assert (versions.committed, versions.missed, versions.trainer) == (1, 0, 1)
    with versions.push_point() as point:
        push = point.begin(hand_off=True)  # a background push ends it on its own thread
    assert versions.in_flight == 2
    push.commit()
    push.abandon()  # a push ends once
    assert (versions.committed, versions.in_flight, versions.missed) == (2, None, 0)


def test_another_rank_adopts_rank_zeros_versions_by_name_and_a_spawned_copy_works():
    rank_zero, other = play("bcbsa"), WeightVersions()
    with other.push_point() as point:
        point.adopt(VersionState.from_ints(rank_zero.state().to_ints()))
    assert (other.committed, other.in_flight, other.missed, other.trainer) == (1, None, 2, 3)
    with other.push_point() as point:
        point.adopt(VersionState(committed=4))
    assert (other.committed, other.missed, other.trainer) == (4, 0, 4)
    copy = pickle.loads(pickle.dumps(rank_zero))
    assert copy.state() == rank_zero.state() and copy.next == 2


def test_an_engine_further_on_moves_the_count_and_a_negative_version_is_refused():
    versions = play("bc")
    versions.follow(7)
    assert versions.next == 8
    with pytest.raises(ValueError, match="weight_version=-1"):
        WeightVersions().set_committed(-1)
