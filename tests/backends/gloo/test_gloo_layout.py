"""The gloo bucket layout both ends follow (``backends/gloo/messages.py``) and the trainer's staging ring
(``backends/gloo/group.py``)."""

import pytest
import torch

from lightning_vllm.backends.gloo.group import StagingRing
from lightning_vllm.backends.gloo.messages import (
    Bucket,
    Segment,
    TensorSpec,
    bucket_segments,
    choose_segment_ends,
    cut_into_buckets,
    unpack_bucket,
)


def spec(name: str, numel: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    return TensorSpec(name, dtype, (numel,))


def test_whole_layers_share_a_bucket_while_they_fit():
    layer0 = [spec("l.0.a", 10), spec("l.0.b", 10)]  # 80 bytes
    layer1 = [spec("l.1.a", 10), spec("l.1.b", 10)]
    layer2 = [spec("l.2.a", 5)]
    buckets = cut_into_buckets([layer0, layer1, layer2], bucket_size_bytes=100)
    # layer1 would overflow the first bucket, so it starts a new one; layer2 (20 bytes) joins it.
    assert buckets == [Bucket(0, 2, 80), Bucket(2, 5, 100)]


def test_a_layer_larger_than_a_bucket_is_split_between_tensors():
    layer = [spec("a", 20), spec("b", 20), spec("c", 20)]  # 80 bytes each
    assert cut_into_buckets([layer], bucket_size_bytes=160) == [Bucket(0, 2, 160), Bucket(2, 3, 80)]


def test_a_tensor_larger_than_a_bucket_travels_alone_in_slices():
    specs = [spec("small", 2), spec("huge", 100), spec("tail", 2)]
    buckets = cut_into_buckets([[s] for s in specs], bucket_size_bytes=64)
    assert buckets == [Bucket(0, 1, 8), Bucket(1, 2, 400), Bucket(2, 3, 8)]
    (huge,) = bucket_segments(specs, buckets[1], choose_segment_ends(specs, buckets, coalesce_bytes=64))
    assert list(huge.slices(64))[-1] == (384, 400)
    assert sum(end - begin for begin, end in huge.slices(64)) == 400


def test_every_tensor_is_planned_exactly_once():
    groups = [[spec(f"l.{i}.{j}", (i * 7 + j * 3) % 50 + 1) for j in range(3)] for i in range(20)]
    buckets = cut_into_buckets(groups, bucket_size_bytes=256)
    assert [b.start for b in buckets][1:] == [b.stop for b in buckets][:-1]
    assert buckets[0].start == 0 and buckets[-1].stop == 60
    assert all(b.num_bytes <= 256 or b.stop - b.start == 1 for b in buckets)


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_size_bytes=0"):
        cut_into_buckets([[spec("a", 1)]], bucket_size_bytes=0)


def test_unpack_restores_names_dtypes_and_shapes():
    a = torch.randn(3, 4)
    b = torch.randn(5).to(torch.bfloat16)
    buffer = torch.cat([a.view(-1).view(torch.uint8), b.view(torch.uint8)])
    specs = [TensorSpec("a", torch.float32, (3, 4)), TensorSpec("b", torch.bfloat16, (5,))]
    (name_a, got_a), (name_b, got_b) = unpack_bucket(buffer, specs)
    assert (name_a, name_b) == ("a", "b")
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


def test_small_tensors_share_a_segment_and_large_ones_travel_alone():
    specs = [
        spec("a", 4),
        spec("b", 4),
        spec("big", 40),
        spec("c", 4),
        spec("d", 4),
        spec("e", 4),
    ]  # 16, 16, 160, 16...
    buckets = cut_into_buckets([specs], bucket_size_bytes=1024)
    ends = choose_segment_ends(specs, buckets, coalesce_bytes=40)
    # a+b pack (32 bytes); big (>= 40) is alone; c+d pack, e would overflow 40 so it starts a new segment.
    assert ends == [2, 3, 5, 6]
    assert bucket_segments(specs, buckets[0], ends) == [
        Segment(0, 2, 0, 32),
        Segment(2, 3, 32, 160),
        Segment(3, 5, 192, 32),
        Segment(5, 6, 224, 16),
    ]


def test_segments_never_cross_a_bucket_and_cover_every_byte():
    groups = [[spec(f"l.{i}.{j}", (i * 7 + j * 3) % 50 + 1) for j in range(3)] for i in range(20)]
    specs = [s for group in groups for s in group]
    buckets = cut_into_buckets(groups, bucket_size_bytes=256)
    ends = choose_segment_ends(specs, buckets, coalesce_bytes=64)
    assert {b.stop for b in buckets} <= set(ends) and ends == sorted(set(ends))
    for bucket in buckets:
        segments = bucket_segments(specs, bucket, ends)
        assert segments[0].start == bucket.start and segments[-1].stop == bucket.stop
        assert sum(segment.num_bytes for segment in segments) == bucket.num_bytes
        assert all(s.num_bytes <= 64 or s.stop - s.start == 1 for s in segments)


def test_a_huge_segment_is_sliced_at_bucket_size_from_its_offset():
    assert list(Segment(0, 1, 16, 150).slices(64)) == [(16, 80), (80, 144), (144, 166)]


# The staging ring hands out regions in order and never one whose bytes are still being read.


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
