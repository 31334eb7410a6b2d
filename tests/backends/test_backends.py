"""The backends as objects: choosing one for an engine, their traits and checks, and the trainer-side
settings handed to vLLM's own engines (NCCL, IPC)."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from lightning_vllm import VLLMUpdater, VLLMWeightSync
from lightning_vllm.backends.base import GroupSettings
from lightning_vllm.backends.gloo.messages import GlooTrainerInitInfo
from lightning_vllm.backends.registry import backend_for_engine, backend_named, check_requested
from lightning_vllm.errors import EngineConfigError


def test_auto_follows_the_engines_weight_transfer_config():
    # Not the trainer's hardware: the engine's config is what both sides must agree on.
    for engine_backend in ("gloo", "nccl", "ipc"):
        assert backend_for_engine("auto", engine_backend, "the test").name == engine_backend


def test_explicit_backends_must_match_the_engine_and_unknown_ones_are_named():
    assert backend_for_engine("ipc", "ipc", "the test").name == "ipc"
    with pytest.raises(EngineConfigError, match="expects weight-transfer backend 'nccl' but this updater uses 'ipc'"):
        backend_for_engine("ipc", "nccl", "the test")
    for refused in (lambda: check_requested("mpi"), lambda: VLLMUpdater(backend="mpi")):
        with pytest.raises(ValueError, match="backend='mpi'. Must be one of 'auto', 'gloo', 'nccl', 'ipc'"):
            refused()
    with pytest.raises(EngineConfigError, match="backend 'sparse_nccl', which lightning-vllm does not send over"):
        backend_for_engine("auto", "sparse_nccl", "the test")


def test_every_ranks_shares_need_a_backend_that_carries_them():
    # vLLM's NCCL engine sends from one rank; our gloo backend takes every rank's share.
    for refused in (
        lambda: check_requested("nccl", every_rank=True),
        lambda: VLLMWeightSync(backend="nccl", push_from="every_rank"),
    ):
        with pytest.raises(ValueError, match="push_from='every_rank'.*backend='nccl' cannot carry.*backend='gloo'"):
            refused()
    check_requested("gloo", every_rank=True)
    check_requested("auto", every_rank=True)  # (the connection checks the engine's own)


def test_the_traits_say_what_the_package_asks_of_a_backend():
    gloo, nccl, ipc, lightning_ipc = (backend_named(name).traits for name in ("gloo", "nccl", "ipc", "lightning_ipc"))
    assert (gloo.loads_while_receiving, gloo.carries_adapters, gloo.carries_shares, gloo.needs_cuda) == (
        False,
        True,
        True,
        False,
    )
    for vllms in (nccl, ipc, lightning_ipc):
        assert (vllms.loads_while_receiving, vllms.carries_adapters, vllms.carries_shares, vllms.needs_cuda) == (
            True,
            False,
            False,
            True,
        )


def test_vllms_gpu_engines_need_cuda_in_the_trainer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend_named("gloo").check_trainer()
    for backend in ("nccl", "ipc"):
        with pytest.raises(EngineConfigError, match=f"backend='{backend}' sends from the trainer's GPU.*'gloo'"):
            backend_named(backend).check_trainer()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend_named("nccl").check_trainer()


SETTINGS = dict(master_address="127.0.0.1", world_size=3, bucket_size_bytes=1 << 20, timeout_seconds=5.0)


def trainer_init_info(backend: str, **settings):
    return backend_named(backend).init_info(GroupSettings(**{**SETTINGS, **settings}))


def test_gloo_settings_keep_port_zero_for_the_transport_to_pick():
    info = trainer_init_info("gloo", master_port=None)
    assert isinstance(info, GlooTrainerInitInfo) and info.backend == "gloo"
    assert (info.master_port, info.world_size, info.bucket_size_bytes, info.is_sender) == (0, 3, 1 << 20, True)


def test_nccl_uses_vllms_packed_engine_with_our_bucket_size():
    info = trainer_init_info("nccl", master_port=None)
    assert isinstance(info, NCCLTrainerInitInfo)
    assert info.packed and info.packed_buffer_size_bytes == 1 << 20
    assert info.world_size == 3 and 0 < info.master_port < 65536
    assert trainer_init_info("nccl", master_port=29555).master_port == 29555


def test_ipc_hands_the_engine_the_trainers_own_tensors_when_they_are_in_its_dtypes():
    # Packed (one converted buffer at a time, bounded memory) unless the trainer holds what the engine loads.
    info = trainer_init_info("ipc", master_port=None)
    assert isinstance(info, IPCTrainerInitInfo) and info.packed and info.packed_buffer_size_bytes == 1 << 20
    assert not trainer_init_info("ipc", master_port=None, sends_as_held=True).packed  # vLLM's unpacked mode


def test_lightning_ipc_names_our_trainer_engine_in_vllms_factory():
    # vLLM's IPC protocol on both sides; the trainer engine (backends/lightning_ipc/trainer.py) keeps handles open.
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesIPCTrainerEngine

    info = trainer_init_info("lightning_ipc", master_port=None, sends_as_held=True, timeout_seconds=7.0)
    assert isinstance(info, IPCTrainerInitInfo) and info.backend == "lightning_ipc" and not info.packed
    assert info.landed_timeout_seconds == 7.0  # the wait for the worker's copies, bounded as the push is
    assert not info.updates_in_one_call  # vLLM's three calls, unless the engine takes them as one
    assert trainer_init_info(
        "lightning_ipc", master_port=None, sends_as_held=True, updates_in_one_call=True
    ).updates_in_one_call
    with pytest.raises(RuntimeError, match="accelerator"):  # vLLM's IPC engine needs a GPU; registering came first
        backend_named("lightning_ipc").join(GroupSettings(**SETTINGS, master_port=None), None, {})
    assert WeightTransferTrainerFactory._registry["lightning_ipc"]() is KeptHandlesIPCTrainerEngine
    assert trainer_init_info("lightning_ipc", master_port=None).packed  # not in the engine's dtypes: vLLM's packed


def test_ipc_is_refused_with_several_trainer_processes(monkeypatch):
    # vLLM's IPC engine would wait in an all-gather for ranks that never send (we push from rank 0).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(EngineConfigError, match="backend='ipc' with 2 trainer processes.*'nccl'"):
        backend_named("ipc").check_trainer()
    backend_named("nccl").check_trainer()


def test_ipc_buffers_grow_to_hold_the_largest_tensor():
    # vLLM's packed IPC producer refuses a tensor larger than its buffer (seen on an H200: a 0.47 GB embedding).
    info = trainer_init_info("ipc", master_port=None, largest_tensor_bytes=3 << 20)
    assert info.packed_buffer_size_bytes == 3 << 20
    assert trainer_init_info("ipc", master_port=None, largest_tensor_bytes=1).packed_buffer_size_bytes == 1 << 20


@pytest.mark.parametrize("raised_by", ["the trainer's init", "the worker's init, as the cause"])
def test_nccl_into_a_worker_on_the_trainers_gpu_is_refused_naming_what_to_use(raised_by, monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    # vLLM's NCCL wrapper passes NCCL's last error on (seen on an H200, docs/runs.md).
    nccl_said = RuntimeError(
        "NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)\nLast error:\n"
        "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60"
    )

    def trainer_init(init_info, *, client, source=None):
        if raised_by == "the trainer's init":
            raise nccl_said
        raise RuntimeError("the engine failed to initialise its weight-transfer engine") from nccl_said

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", staticmethod(trainer_init))
    settings = GroupSettings(**{**SETTINGS, "master_port": 29555})
    with pytest.raises(
        EngineConfigError, match="backend='nccl' with a vLLM worker on the trainer's own GPU"
    ) as refused:
        backend_named("nccl").join(settings, client=None, engine_metadata={})
    assert "'lightning_ipc'" in str(refused.value) and "CUDA_VISIBLE_DEVICES" in str(refused.value)

    def other_failure(init_info, *, client, source=None):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", staticmethod(other_failure))
    with pytest.raises(RuntimeError, match="unhandled system error"):  # anything else is raised as it is
        backend_named("nccl").join(settings, client=None, engine_metadata={})
