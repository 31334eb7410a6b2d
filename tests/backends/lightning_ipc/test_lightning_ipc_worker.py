"""``lightning_ipc``'s worker side, engine-free: what it accepts from a trainer. Loading with kept slots,
recorded copies and the landing event needs CUDA: the GPU tier runs it (``tests/gpu/test_gpu_lightning_ipc.py``)."""

from __future__ import annotations

import pytest

from lightning_vllm.backends.lightning_ipc.worker import KeptHandlesUpdateInfo

FIELDS = dict(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1], [1]], ipc_handles=[{}, {}])


def test_an_update_names_a_slot_for_each_tensor_or_none():
    assert KeptHandlesUpdateInfo(**FIELDS, slots=[0, 1]).released == []
    assert KeptHandlesUpdateInfo(**FIELDS).slots is None  # from vLLM's own IPC trainer engine
    with pytest.raises(ValueError, match="`slots` should be of the same size as `names`: got 1 and 2"):
        KeptHandlesUpdateInfo(**FIELDS, slots=[0])


def test_vllms_own_checks_still_hold():
    with pytest.raises(ValueError, match="`ipc_handles` should be of the same size as `names`"):
        KeptHandlesUpdateInfo(**{**FIELDS, "ipc_handles": [{}]}, slots=[0, 1])
