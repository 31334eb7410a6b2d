import json
from importlib.metadata import entry_points

import pytest
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

from lightning_vllm.backends.gloo.trainer import GlooTrainerWeightTransferEngine
from lightning_vllm.backends.gloo.worker import GlooWeightTransferEngine
from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesIPCTrainerEngine
from lightning_vllm.backends.lightning_ipc.worker import InPlaceIPCWeightTransferEngine, loads_as_held
from lightning_vllm.backends.lightning_nccl.worker import StagedNCCLWeightTransferEngine
from lightning_vllm.in_vllm.plugin import register_backends


def test_vllm_finds_the_plugin_through_its_entry_point_group():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["lightning_vllm_gloo"] == "lightning_vllm.in_vllm.plugin:register_backends"


def test_registering_twice_is_harmless_and_both_halves_resolve():
    register_backends()
    register_backends()  # vLLM may load plugins more than once in a process
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is GlooTrainerWeightTransferEngine
    assert WeightTransferEngineFactory._registry["lightning_ipc"]() is InPlaceIPCWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["lightning_ipc"]() is KeptHandlesIPCTrainerEngine
    assert WeightTransferEngineFactory._registry["lightning_nccl"]() is StagedNCCLWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["lightning_nccl"]() is NCCLTrainerWeightTransferEngine


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


IN_VLLM = {
    "", "errors", "settings", "_waits",
    "in_vllm", "in_vllm.plugin", "in_vllm.busy_wait", "in_vllm.lora_ops", "in_vllm.lora_adapters",
    "in_vllm.worker_methods",
    "backends", "backends.gloo", "backends.gloo.worker", "backends.gloo.receiver", "backends.gloo.group",
    "backends.gloo.messages", "backends.gloo.rendezvous", "backends.gloo.tied_embedding_fix",
    "backends.gloo.moe_prepack_fix",
    "backends.nccl", "backends.nccl.worker",
    "backends.lightning_ipc", "backends.lightning_ipc.worker", "backends.lightning_ipc.recorded_loads",
    "backends.lightning_nccl", "backends.lightning_nccl.worker",
}  # fmt: skip
"""What a vLLM process loads of this package (names under ``lightning_vllm``; ``""``: the package): the plugin and
what it applies, each backend's worker side, and the errors, settings and bounded waits they share with the trainer.
Not the trainer's side of any backend, nor the core, the weights, the engines or the front ends; not Lightning."""


# In a fresh interpreter, as vLLM loads plugins in its front end, engine core and every worker, then builds each of our
# worker engines as a worker does: none of them trains, and a plugin that fails to import is only logged.
LOAD_AS_VLLM_DOES = (
    "import json, sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
    "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as W, "
    "WeightTransferTrainerFactory as T; "
    "print(json.dumps({'registered': 'gloo' in W._registry and 'gloo' in T._registry, "
    "'workers': [W._registry[name]().__module__ for name in ('gloo', 'lightning_ipc', 'nccl', 'lightning_nccl')], "
    "'loaded': sorted(name for name in sys.modules if name.split('.')[0] in "
    "('lightning', 'pytorch_lightning', 'lightning_fabric', 'lightning_vllm'))}))"
)


@pytest.mark.fresh_interpreter(LOAD_AS_VLLM_DOES)
def test_vllms_processes_load_the_plugin_and_the_workers_sides_and_nothing_of_the_trainers(fresh_interpreter):
    assert fresh_interpreter.returncode == 0, fresh_interpreter.stderr[-2000:]
    found = json.loads(fresh_interpreter.stdout.strip().splitlines()[-1])
    assert found["registered"]
    backends = ("gloo", "lightning_ipc", "nccl", "lightning_nccl")
    assert found["workers"] == [f"lightning_vllm.backends.{name}.worker" for name in backends]
    assert set(found["loaded"]) == {f"lightning_vllm.{name}".rstrip(".") for name in IN_VLLM}


def test_the_package_still_offers_its_names_on_first_use():
    import lightning_vllm

    assert lightning_vllm.VLLMWeightSync.__name__ == "VLLMWeightSync"
    assert set(lightning_vllm.__all__) <= set(dir(lightning_vllm))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = lightning_vllm.Nope
