import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lightning_vllm.transports.gloo import GlooTrainerWeightTransferEngine, GlooWeightTransferEngine
from lightning_vllm.transports.ipc_trainer import KeptHandlesIPCTrainerEngine
from lightning_vllm.transports.ipc_worker import InPlaceIPCWeightTransferEngine, loads_as_held
from lightning_vllm.transports.plugin import register_backends


def test_vllm_finds_the_plugin_through_its_entry_point_group():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["lightning_vllm_gloo"] == "lightning_vllm.transports.plugin:register_backends"


def test_registering_twice_is_harmless_and_both_halves_resolve():
    register_backends()
    register_backends()  # vLLM may load plugins more than once in a process
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is GlooTrainerWeightTransferEngine
    assert WeightTransferEngineFactory._registry["lightning_ipc"]() is InPlaceIPCWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["lightning_ipc"]() is KeptHandlesIPCTrainerEngine


def test_lightning_ipc_loads_in_place_only_where_vllm_uses_weights_as_loaded():
    from types import SimpleNamespace

    def config(quantization=None, use_mla=False, cache_dtype="auto"):
        model = SimpleNamespace(quantization=quantization, use_mla=use_mla)
        return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype))

    assert not loads_as_held(config())  # this machine has no CUDA: vLLM's CPU build repacks linear layers
    with pytest.MonkeyPatch.context() as patch:
        from vllm.platforms import current_platform

        patch.setattr(type(current_platform), "is_cuda", lambda self: True)
        assert loads_as_held(config())
        assert not loads_as_held(config(quantization="fp8"))
        assert not loads_as_held(config(use_mla=True))
        assert not loads_as_held(config(cache_dtype="fp8_e4m3"))


def test_vllms_plugin_loader_registers_gloo_and_loads_the_transport_not_lightning():
    # In a fresh interpreter, as vLLM loads plugins in its front end, engine core and every
    # worker: none of them trains, and a plugin that fails to import is only logged there.
    code = (
        "import sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as W, "
        "WeightTransferTrainerFactory as T; print('gloo' in W._registry and 'gloo' in T._registry); "
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('lightning', 'pytorch_lightning') "
        "or name in ('lightning_vllm.callback', 'lightning_vllm.core.weight_sync')))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.stdout.strip().splitlines()[-2:] == ["True", "[]"], completed.stderr[-2000:]


def test_the_package_still_offers_its_names_on_first_use():
    import lightning_vllm

    assert lightning_vllm.VLLMWeightSync.__name__ == "VLLMWeightSync"
    assert set(lightning_vllm.__all__) <= set(dir(lightning_vllm))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = lightning_vllm.Nope
