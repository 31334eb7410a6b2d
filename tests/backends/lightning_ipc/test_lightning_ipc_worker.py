"""``lightning_ipc``'s worker side, engine-free: what it accepts from a trainer. Loading with kept slots,
recorded copies and the landing event needs CUDA: the GPU tier runs it (``tests/gpu/test_gpu_lightning_ipc.py``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from lightning_vllm.backends.lightning_ipc.worker import (
    KeptHandlesUpdateInfo,
    PushExpiredError,
    refuse_if_expired,
    update_in_one_call,
)

FIELDS = dict(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1], [1]], ipc_handles=[{}, {}])


def test_an_update_names_a_slot_for_each_tensor_or_none():
    assert KeptHandlesUpdateInfo(**FIELDS, slots=[0, 1]).released == []
    assert KeptHandlesUpdateInfo(**FIELDS).slots is None  # from vLLM's own IPC trainer engine
    with pytest.raises(ValueError, match="`slots` should be of the same size as `names`: got 1 and 2"):
        KeptHandlesUpdateInfo(**FIELDS, slots=[0])


def test_vllms_own_checks_still_hold():
    with pytest.raises(ValueError, match="`ipc_handles` should be of the same size as `names`"):
        KeptHandlesUpdateInfo(**{**FIELDS, "ipc_handles": [{}]}, slots=[0, 1])


class RecordingWorker:
    """Takes the calls ``update_in_one_call`` makes on vLLM's worker."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")


def test_a_push_that_reaches_the_worker_after_its_deadline_is_refused_before_the_update_starts():
    worker = RecordingWorker()
    update_in_one_call(worker, {**FIELDS, "apply_before": time.monotonic() + 60})
    assert worker.calls == ["start", "update", "finish"]
    with pytest.raises(PushExpiredError, match=r"reached the vLLM worker \d+\.\d\d s after .* it was not loaded"):
        update_in_one_call(worker, {**FIELDS, "apply_before": time.monotonic() - 2})
    assert worker.calls == ["start", "update", "finish"]  # nothing more: no update was opened
    update_in_one_call(worker, dict(FIELDS))  # a trainer that sets no deadline (vLLM's own IPC trainer engine)
    assert len(worker.calls) == 6


def test_the_deadline_is_a_field_of_the_update_the_worker_parses():
    assert KeptHandlesUpdateInfo(**FIELDS, slots=[0, 1], apply_before=12.5).apply_before == 12.5
    refuse_if_expired(None)
    with pytest.raises(PushExpiredError):
        refuse_if_expired(time.monotonic() - 0.01)
