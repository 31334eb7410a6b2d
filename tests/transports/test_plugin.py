from importlib.metadata import entry_points

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lightning_vllm.transports.gloo import GlooTrainerWeightTransferEngine, GlooWeightTransferEngine
from lightning_vllm.transports.plugin import register_backends


def test_vllm_finds_the_plugin_through_its_entry_point_group():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["lightning_vllm_gloo"] == "lightning_vllm.transports.plugin:register_backends"


def test_registering_twice_is_harmless_and_both_halves_resolve():
    register_backends()
    register_backends()  # vLLM may load plugins more than once in a process
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gloo"]() is GlooTrainerWeightTransferEngine
