"""The shared-memory buffer: who may use it, and the error when a worker cannot see it."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from lightning_vllm.errors import WeightSyncError
from lightning_vllm.transports.gloo import GlooTrainerInitInfo
from lightning_vllm.transports.shared_memory import (
    create_shared_buffer,
    is_loopback,
    open_shared_buffer,
    remove_shared_buffer,
)


def test_both_mappings_see_the_same_bytes_and_only_this_user_may_open_the_file():
    path, trainer_side = create_shared_buffer(64)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        worker_side = open_shared_buffer(path, 64)
        trainer_side[:8].copy_(torch.arange(8, dtype=torch.uint8))
        assert worker_side[:8].tolist() == list(range(8))
    finally:
        remove_shared_buffer(path)
    assert not os.path.exists(path)
    trainer_side[8] = 1  # mappings outlive the file


def test_a_worker_that_cannot_see_the_buffer_is_told_how_to_fall_back_to_tcp():
    with pytest.raises(RuntimeError, match="shared_memory=False"):
        open_shared_buffer("/dev/shm/lightning_vllm_missing", 64)


def test_shared_memory_is_used_by_default_only_towards_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("localhost")
    assert not is_loopback("10.1.2.3")
    assert GlooTrainerInitInfo(master_address="127.0.0.1").uses_shared_memory()
    assert not GlooTrainerInitInfo(master_address="10.1.2.3").uses_shared_memory()
    assert not GlooTrainerInitInfo(master_address="127.0.0.1", shared_memory=False).uses_shared_memory()


def test_asking_for_shared_memory_without_dev_shm_is_an_error(monkeypatch):
    monkeypatch.setattr("lightning_vllm.transports.gloo.shared_memory_available", lambda: False)
    with pytest.raises(WeightSyncError, match="no writable /dev/shm"):
        GlooTrainerInitInfo(shared_memory=True).uses_shared_memory()
