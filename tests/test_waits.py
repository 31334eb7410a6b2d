"""Bounded waits: every wait ends, with the error that says why."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_vllm._waits import call_watched, call_with_timeout, wait_polling
from lightning_vllm.engines.client import TimedClient
from lightning_vllm.errors import WeightSyncTimeoutError


def test_a_call_that_never_returns_times_out_naming_what_it_waited_for():
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="Timed out after 0.2 s waiting for the moon"):
        call_with_timeout(never.wait, timeout=0.2, what="the moon")
    assert time.monotonic() - start < 2


def test_a_watched_call_that_times_out_says_how_long_it_was_waited_for():
    # (it said "after 0 s", the time left at its last check: seen on the H200 over nccl and lightning_ipc)
    never = threading.Event()
    with pytest.raises(WeightSyncTimeoutError, match="Timed out after 0.3 s waiting for the transfer"):
        call_watched(never.wait, timeout=0.3, what="the transfer", check=lambda: None, interval=0.05)


def test_a_call_s_own_error_is_raised_as_it_is():
    def fail():
        raise KeyError("inner")

    with pytest.raises(KeyError, match="inner"):
        call_with_timeout(fail, timeout=1, what="a failing call")


def test_polling_ends_when_done_when_checked_or_when_time_is_up():
    answers = iter([False, False, True])
    wait_polling(lambda: next(answers), timeout=1, interval=0.001, timeout_error=lambda: AssertionError("late"))

    def other_side_failed():
        raise RuntimeError("the workers failed")

    with pytest.raises(RuntimeError, match="the workers failed"):
        wait_polling(lambda: False, timeout=1, interval=0.001, timeout_error=TimeoutError, check=other_side_failed)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="gave up"):
        wait_polling(
            lambda: False, timeout=0.05, interval=0.01, timeout_error=lambda: WeightSyncTimeoutError("gave up")
        )
    assert time.monotonic() - start < 1


class VersionRecorder:
    def __init__(self) -> None:
        self.committed: list[str | None] = []

    def finish_weight_update(self, weight_version=None):
        self.committed.append(weight_version)


def test_a_client_made_for_one_push_commits_that_push_s_version():
    inner = VersionRecorder()
    client = TimedClient(inner, timeout=5)
    client.finish_weight_update()  # as vLLM's trainer engines call it: no version
    client.committing("3").finish_weight_update()
    client.committing("3").finish_weight_update("4")  # an explicit version wins
    assert inner.committed == [None, "3", "4"]
    assert client.weight_version is None  # the original is unchanged


def test_calls_reuse_idle_threads_and_one_that_never_returns_keeps_its_own():
    def caller_thread() -> threading.Thread:
        return threading.current_thread()

    first = call_with_timeout(caller_thread, timeout=5, what="a first call")
    assert first is not threading.current_thread() and first.daemon
    assert call_with_timeout(caller_thread, timeout=5, what="a second call") is first  # idle again: reused
    never = threading.Event()
    with pytest.raises(WeightSyncTimeoutError):
        call_with_timeout(never.wait, timeout=0.05, what="a call that hangs")
    stuck = [thread for thread in threading.enumerate() if thread.name == "lightning-vllm: a call that hangs"]
    assert len(stuck) == 1  # named after what it waits for
    other = call_with_timeout(caller_thread, timeout=5, what="a call after it")
    assert other is not stuck[0]  # the hung thread is not handed new calls
    never.set()
    deadline = time.monotonic() + 5
    while stuck[0].name != "lightning-vllm: idle caller" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stuck[0].name == "lightning-vllm: idle caller"  # once it returned, back in the pool


def test_at_most_a_few_idle_threads_are_kept_after_many_calls_at_once():
    from lightning_vllm._waits import BackgroundCall

    release = threading.Event()
    before = threading.active_count()
    calls = [BackgroundCall(release.wait, 5, what=f"call {index}") for index in range(20)]
    release.set()
    for call in calls:
        call.result(timeout=5)
    deadline = time.monotonic() + 5
    while threading.active_count() > before + 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before + 8


class OneCallRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def update_weights_in_one_call(self, update_on_worker, update_info, weight_version):
        self.calls.append(("one call", weight_version))


def test_an_update_in_one_call_commits_the_push_s_version_inside_its_commit_window():
    from lightning_vllm.engines.base import UpdatesInOneCall
    from lightning_vllm.engines.client import AbandonedClient, CommitWindow
    from lightning_vllm.errors import WeightSyncError

    inner = OneCallRecorder()
    assert isinstance(inner, UpdatesInOneCall)

    class Engine:  # (the engine's generation calls, recorded beside the client's)
        description = "the engine"

        def pause_generation(self, mode: str) -> None:
            inner.calls.append(("pause", mode))

        def resume_generation(self) -> None:
            inner.calls.append(("resume", None))

        def reset_prefix_cache(self) -> None:
            inner.calls.append(("reset", None))

    window = CommitWindow(Engine(), timeout=5, pause_mode="keep", reset_prefix_cache=True)
    TimedClient(inner, timeout=5).committing("7", window).update_weights_in_one_call(print, {"names": []})
    assert inner.calls == [("pause", "keep"), ("one call", "7"), ("reset", None), ("resume", None)]
    assert 0 < window.commit_seconds <= window.pause_seconds
    with pytest.raises(WeightSyncError, match="had already failed"):
        AbandonedClient("The push").update_weights_in_one_call(print, {"names": []})


def test_a_call_made_inside_a_bounded_call_runs_on_its_thread_when_the_outer_wait_ends_first():
    threads: dict[str, threading.Thread] = {}

    def transfer() -> None:  # as a transfer's control call, inside call_watched
        threads["transfer"] = threading.current_thread()
        call_with_timeout(lambda: threads.setdefault("same wait", threading.current_thread()), timeout=5, what="x")
        call_with_timeout(lambda: threads.setdefault("longer wait", threading.current_thread()), timeout=60, what="x")
        # A shorter wait than the outer one is still its own: it times out by itself.
        with pytest.raises(WeightSyncTimeoutError, match="a short wait"):
            call_with_timeout(time.sleep, 1, timeout=0.05, what="a short wait")
        threads["short wait"] = threading.current_thread()

    call_watched(transfer, timeout=5, what="the transfer", check=lambda: None, interval=0.5)
    assert threads["transfer"] is not threading.current_thread()
    assert threads["same wait"] is threads["longer wait"] is threads["short wait"] is threads["transfer"]


def test_a_call_inside_a_bounded_call_that_hangs_is_ended_by_the_outer_wait():
    hung = threading.Event()

    def transfer() -> None:
        call_with_timeout(hung.wait, 10, timeout=30, what="the engine to answer")

    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="the transfer"):
        call_watched(transfer, timeout=0.2, what="the transfer", check=lambda: None, interval=0.05)
    assert time.monotonic() - started < 2
    hung.set()
