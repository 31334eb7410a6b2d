"""engine_on_gpus: an engine started inside sees the GPUs named, as this process numbers them; the variable is put
back; bad placements are refused with the fix. This machine has no GPU: CUDA's answers are given (the GPU tier's
``tests/gpu/nccl`` starts engines on another GPU than the trainer's)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_vllm import engine_on_gpus
from lightning_vllm.errors import EngineConfigError


@pytest.fixture
def four_gpus(monkeypatch):
    initialized = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "init", lambda: initialized.append(True))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return initialized


def test_the_engine_sees_the_gpus_named_as_this_process_numbers_them_and_the_variable_comes_back(
    four_gpus, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with engine_on_gpus(1, 2):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert four_gpus == [True]  # (CUDA in use first: this process's view is fixed, and vLLM spawns)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="engine failed"), engine_on_gpus(3):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
        raise RuntimeError("engine failed")
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize("gpus", [(), (1, 1), (4,), (-1,)])
def test_a_placement_that_cannot_be_is_refused_naming_the_gpus_this_process_sees(four_gpus, gpus):
    with pytest.raises(EngineConfigError, match="0 to 3: it sees 4"), engine_on_gpus(*gpus):
        pass


def test_an_engine_core_in_this_process_cannot_be_placed(four_gpus, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(EngineConfigError, match="unset it"), engine_on_gpus(1):
        pass
    assert four_gpus == []


def test_without_cuda_it_says_so():
    with pytest.raises(EngineConfigError, match="sees none"), engine_on_gpus(0):
        pass


def test_an_engine_the_package_builds_gets_the_tables_backend_for_where_it_is_unless_its_arguments_say():
    from lightning_vllm.engines.local import local_engine_args

    own = local_engine_args({"model": "m"}, gpus=(6, 7), cuda_available=True)
    assert own == {"weight_transfer_config": {"backend": "lightning_nccl"}, "tensor_parallel_size": 2, "model": "m"}
    beside = local_engine_args({"model": "m"}, gpus=(), cuda_available=True)
    assert beside["weight_transfer_config"] == {"backend": "lightning_ipc"} and "tensor_parallel_size" not in beside
    assert local_engine_args({}, gpus=(), cuda_available=False)["weight_transfer_config"] == {"backend": "gloo"}
    given = {"weight_transfer_config": {"backend": "nccl"}, "tensor_parallel_size": 1}
    assert local_engine_args(given, gpus=(1, 2), cuda_available=True) == given


def test_the_callback_places_only_an_engine_it_builds():
    from lightning_vllm import VLLMWeightSync

    with pytest.raises(ValueError, match="inside lightning_vllm.engine_on_gpus"):
        VLLMWeightSync(engine="http://127.0.0.1:8000", engine_gpus=[1])
    assert VLLMWeightSync(engine={"model": "m"}, engine_gpus=[1])._engine_gpus == (1,)
