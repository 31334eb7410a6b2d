"""Bounded waits: every wait ends, with the error that says why."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_vllm._waits import call_with_timeout, wait_polling
from lightning_vllm.engine_client import TimedClient
from lightning_vllm.errors import WeightSyncTimeoutError


def test_a_call_that_never_returns_times_out_naming_what_it_waited_for():
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="Timed out after 0.2 s waiting for the moon"):
        call_with_timeout(never.wait, timeout=0.2, what="the moon")
    assert time.monotonic() - start < 2


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
