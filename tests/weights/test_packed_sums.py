"""The worker's fingerprints of the layers vLLM's CPU build packs: the thread that takes them beside the load.
(What they catch in vLLM's real worker: ``test_with_vllm.py``, and the check's fault tests.)"""

from __future__ import annotations

import os
import threading

import pytest

from lightning_vllm.weights.packed_sums import _off_the_bound_cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores this process may use")
def test_the_fingerprints_thread_leaves_the_cores_vllm_bound_the_worker_to():
    # vLLM binds its CPU worker's thread to its cores, and a thread starts bound as its starter is; the thread that
    # fingerprints moves to the other cores, which the load leaves idle (the trainer waits for it).
    cores = sorted(os.sched_getaffinity(0))
    found: dict[str, set[int]] = {}

    def bound_worker() -> None:
        os.sched_setaffinity(0, {cores[0]})

        def fingerprints() -> None:
            found["started"] = os.sched_getaffinity(0)
            _off_the_bound_cores()
            found["moved"] = os.sched_getaffinity(0)

        thread = threading.Thread(target=fingerprints)
        thread.start()
        thread.join(timeout=10)

    worker = threading.Thread(target=bound_worker)
    worker.start()
    worker.join(timeout=10)
    assert found == {"started": {cores[0]}, "moved": set(cores[1:])}


def test_a_thread_given_every_core_stays_where_it_is():
    found: dict[str, set[int]] = {}

    def fingerprints() -> None:
        before = os.sched_getaffinity(0)
        _off_the_bound_cores()
        found["kept"] = os.sched_getaffinity(0) == before

    thread = threading.Thread(target=fingerprints)
    thread.start()
    thread.join(timeout=10)
    assert found == {"kept": True}
