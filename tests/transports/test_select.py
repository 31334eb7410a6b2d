"""Backend choice and the trainer-side settings handed to vLLM's own engines (NCCL, IPC)."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from lightning_vllm.errors import EngineConfigError
from lightning_vllm.transports import check_trainer_can_send, resolve_backend, trainer_init_info
from lightning_vllm.transports.gloo import GlooTrainerInitInfo


def test_auto_follows_the_engines_weight_transfer_config():
    # Not the trainer's hardware: the engine's config is what both sides must agree on.
    for engine_backend in ("gloo", "nccl", "ipc"):
        assert resolve_backend("auto", engine_backend=engine_backend) == engine_backend


def test_explicit_backends_are_kept_and_unknown_ones_named():
    assert resolve_backend("ipc", engine_backend="nccl") == "ipc"
    with pytest.raises(ValueError, match="backend='mpi'"):
        resolve_backend("mpi", engine_backend="gloo")


def test_vllms_gpu_engines_need_cuda_in_the_trainer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_trainer_can_send("gloo")
    for backend in ("nccl", "ipc"):
        with pytest.raises(EngineConfigError, match=f"backend='{backend}' sends from the trainer's GPU.*'gloo'"):
            check_trainer_can_send(backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_trainer_can_send("nccl")


SETTINGS = dict(master_address="127.0.0.1", world_size=3, bucket_size_bytes=1 << 20, timeout_seconds=5.0)


def test_gloo_settings_keep_port_zero_for_the_transport_to_pick():
    info = trainer_init_info("gloo", master_port=None, **SETTINGS)
    assert isinstance(info, GlooTrainerInitInfo) and info.backend == "gloo"
    assert (info.master_port, info.world_size, info.bucket_size_bytes, info.is_sender) == (0, 3, 1 << 20, True)


def test_nccl_uses_vllms_packed_engine_with_our_bucket_size():
    info = trainer_init_info("nccl", master_port=None, **SETTINGS)
    assert isinstance(info, NCCLTrainerInitInfo)
    assert info.packed and info.packed_buffer_size_bytes == 1 << 20
    assert info.world_size == 3 and 0 < info.master_port < 65536
    assert trainer_init_info("nccl", master_port=29555, **SETTINGS).master_port == 29555


def test_ipc_uses_vllms_packed_engine():
    info = trainer_init_info("ipc", master_port=None, **SETTINGS)
    assert isinstance(info, IPCTrainerInitInfo) and info.packed and info.packed_buffer_size_bytes == 1 << 20


def test_ipc_is_refused_with_several_trainer_processes(monkeypatch):
    # vLLM's IPC engine would wait in an all-gather for ranks that never send (we push from rank 0).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(EngineConfigError, match="backend='ipc' with 2 trainer processes.*'nccl'"):
        check_trainer_can_send("ipc")
    check_trainer_can_send("nccl")


def test_ipc_buffers_grow_to_hold_the_largest_tensor():
    # vLLM's packed IPC producer refuses a tensor larger than its buffer (seen on an H200: a 0.47 GB embedding).
    info = trainer_init_info("ipc", master_port=None, largest_tensor_bytes=3 << 20, **SETTINGS)
    assert info.packed_buffer_size_bytes == 3 << 20
    assert (
        trainer_init_info("ipc", master_port=None, largest_tensor_bytes=1, **SETTINGS).packed_buffer_size_bytes
        == 1 << 20
    )
