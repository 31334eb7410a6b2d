"""``lightning_vllm.torchrl.VLLMWeightSyncScheme`` against TorchRL 0.14.1's real code, engine-free: it is a TorchRL
``WeightSyncScheme`` that TorchRL's Hydra config builds, its surface is TorchRL's, and TorchRL's own scheme cannot
reach the installed vLLM's trainer API (why ours exists; this test fails the day TorchRL catches up)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from helpers import tiny_qwen2

torchrl = pytest.importorskip("torchrl", reason="the torchrl extra (make test installs it)")

from lightning_vllm.torchrl import (  # noqa: E402
    VLLMWeightReceiver,
    VLLMWeightSender,
    VLLMWeightSyncScheme,
    get_model_metadata,
)


def test_torchrls_own_scheme_calls_a_trainer_api_the_installed_vllm_no_longer_has():
    from torchrl.weight_update.llm import vllm_nccl
    from vllm.distributed.weight_transfer import nccl_engine

    torchrl_scheme = inspect.getsource(vllm_nccl)
    assert "NCCLWeightTransferEngine.trainer_init(" in torchrl_scheme
    assert "NCCLWeightTransferEngine.trainer_send_weights(" in torchrl_scheme
    assert "NCCLTrainerSendWeightsArgs" in torchrl_scheme
    # vLLM (0.28 on) moved the trainer's side to NCCLTrainerWeightTransferEngine, built with a client and a source.
    assert not hasattr(nccl_engine.NCCLWeightTransferEngine, "trainer_init")
    assert not hasattr(nccl_engine.NCCLWeightTransferEngine, "trainer_send_weights")
    assert not hasattr(nccl_engine, "NCCLTrainerSendWeightsArgs")
    with pytest.raises(ImportError, match="NCCLTrainerSendWeightsArgs"):
        exec("from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs", {})  # as TorchRL's


def test_torchrls_engines_start_an_update_with_an_argument_vllms_call_no_longer_takes():
    from vllm import LLM

    backends = "torchrl.modules.llm.backends.vllm"
    sources = [inspect.getsource(importlib.import_module(f"{backends}.{name}")) for name in ("vllm_sync", "vllm_async")]
    assert all("start_weight_update(is_checkpoint_format=True)" in source for source in sources)
    assert list(inspect.signature(LLM.start_weight_update).parameters) == ["self"]


def test_torchrls_own_sender_fails_before_a_byte_moves_on_this_machine():
    from torchrl.weight_update.llm import VLLMWeightSyncScheme as TorchRLScheme

    sender = TorchRLScheme(master_port=29555).create_sender()
    sender.register_model(tiny_qwen2(seed=0))
    # On a machine without CUDA it stops at torch.cuda.set_device; with CUDA at vLLM's missing trainer_init.
    with pytest.raises((AttributeError, RuntimeError, AssertionError)):
        sender.init_all_workers_group(get_model_metadata(tiny_qwen2(seed=0)), vllm_engine=None)


def test_ours_is_a_torchrl_weight_sync_scheme_with_torchrls_surface():
    from torchrl.weight_update import WeightSyncScheme
    from torchrl.weight_update.llm import VLLMWeightSyncScheme as TorchRLScheme

    assert issubclass(VLLMWeightSyncScheme, WeightSyncScheme)
    theirs = inspect.signature(TorchRLScheme.__init__).parameters
    ours = inspect.signature(VLLMWeightSyncScheme.__init__).parameters
    assert [name for name in theirs] == [name for name in ours][: len(theirs)]
    assert all(ours[name].default == theirs[name].default for name in theirs if name != "master_address")
    scheme = VLLMWeightSyncScheme(gpus_per_replica=2, num_replicas=3)
    assert scheme.master_address == "127.0.0.1"  # loopback, not every interface "localhost" may name
    assert scheme.world_size == 7  # TorchRL's: the trainer and every replica's workers
    sender, receiver = scheme.create_sender(), scheme.create_receiver(vllm_engine=None)
    assert isinstance(sender, VLLMWeightSender) and isinstance(receiver, VLLMWeightReceiver)
    for name in ("register_model", "register_collector", "init_all_workers_group", "update_weights", "shutdown"):
        assert callable(getattr(sender, name))
    assert receiver.poll_and_apply() is False
    assert receiver.apply_weights({}) is None


def test_torchrls_hydra_config_builds_ours_when_it_names_our_class():
    from hydra.utils import instantiate
    from torchrl.trainers.algorithms.configs.weight_sync_schemes import VLLMWeightSyncSchemeConfig

    config = VLLMWeightSyncSchemeConfig(master_port=29556, num_replicas=2)
    config._target_ = "lightning_vllm.torchrl.VLLMWeightSyncScheme"
    scheme = instantiate(config)
    assert isinstance(scheme, VLLMWeightSyncScheme)
    assert (scheme.master_port, scheme.num_replicas, scheme.strategy_name) == (29556, 2, "tensordict")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"gpus_per_replica": 0}, ValueError, "gpus_per_replica must be a positive int"),
        ({"num_replicas": 1.5}, ValueError, "num_replicas must be a positive int"),
        ({"ray_actor": object()}, TypeError, "unexpected keyword"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        VLLMWeightSyncScheme(**kwargs)


def test_a_sender_not_initialized_says_what_to_call():
    sender = VLLMWeightSyncScheme().create_sender()
    with pytest.raises(RuntimeError, match="init_all_workers_group"):
        sender.update_weights()
    with pytest.raises(RuntimeError, match="create_sender"):
        VLLMWeightSyncScheme().send()
    with pytest.raises(RuntimeError, match="no separate transport: use create_sender"):
        VLLMWeightSyncScheme().create_transport()


def test_the_receiver_names_an_engine_it_cannot_serve():
    from lightning_vllm import EngineConfigError

    with pytest.raises(EngineConfigError, match="cannot take lightning_vllm's pushes"):
        VLLMWeightSyncScheme().create_receiver(vllm_engine=object()).init_all_workers_group()


def test_get_model_metadata_is_the_updaters():
    model = tiny_qwen2(seed=0)
    metadata = get_model_metadata(model)
    assert metadata["model.embed_tokens.weight"] == (torch.float32, model.model.embed_tokens.weight.shape)


def test_an_engine_of_another_kind_is_named_before_anything_is_joined():
    from lightning_vllm import EngineConfigError

    sender = VLLMWeightSyncScheme().create_sender()
    with pytest.raises(EngineConfigError, match="vllm_engine \\(object\\).*Unsupported engine object"):
        sender.init_all_workers_group(get_model_metadata(tiny_qwen2(seed=0)), vllm_engine=object())
    assert sender.updater is None
