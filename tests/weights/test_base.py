"""Every weight source satisfies the ``WeightSource`` API of the installed vLLM (0.32, or 0.33 in
``make test-vllm-next``), and sources written for that API are read through ``ForeignWeights``; what changed since
the last push: stamps read without touching a tensor's data, whole layer groups."""

import functools
import os
from functools import cached_property

import pytest
import torch
import vllm
from helpers import lora_policy, tiny_qwen2
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource

from lightning_vllm.lora.adapter import AdapterWeights, adapter_source
from lightning_vllm.weights import DeclaredWeights, EngineWeights, MappingWeights, ModuleWeights, weights_from
from lightning_vllm.weights.base import ParamList, SentStamps, Weights, same_stamp, tensor_stamp, unchanged_names
from lightning_vllm.weights.snapshot import SnapshotMemory
from lightning_vllm.weights.sources import LoraBaseWeights, LoraMergedWeights

VLLM_033 = hasattr(WeightSource, "iter_full")


def test_the_vllm_under_test_is_the_one_asked_for():
    # make test-vllm-next puts vLLM 0.33's sources first on the path: make sure they are what runs.
    expected = os.environ.get("LIGHTNING_VLLM_EXPECT_VLLM")
    if expected is None:
        pytest.skip("LIGHTNING_VLLM_EXPECT_VLLM is set by make test-vllm-next only")
    assert vllm.__version__ == expected
    assert VLLM_033 == (expected >= "0.33")


@functools.cache
def every_source() -> dict[str, Weights]:
    model, peft = tiny_qwen2(), lora_policy()
    module = ModuleWeights(model)
    engine_metadata = {
        meta.name: (torch.bfloat16, meta.shape) for meta in module.metadata if "layers.0" not in meta.name
    }
    return {
        "module": module,
        "mapping": MappingWeights({"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(2, 3)}),
        "lora merged": LoraMergedWeights(peft),
        "lora base": LoraBaseWeights(peft),
        "adapter": AdapterWeights(peft),
        "base and adapter": adapter_source(peft, with_base=True)[0],
        "engine": EngineWeights(module, engine_metadata),
        "snapshot": SnapshotMemory().take(ModuleWeights(model)),
        "foreign (vLLM's ModuleSource)": weights_from(ModuleSource(model)),
    }


@pytest.mark.parametrize("kind", list(every_source()))
def test_each_source_iterates_as_the_installed_vllm_reads_it(kind):
    source = every_source()[kind]
    assert isinstance(source, WeightSource)  # created under the installed base class: its checks passed
    declared = source.metadata
    assert isinstance(declared, ParamList) and source.metadata() is declared  # 0.33 reads it, 0.32 calls it
    pairs = list(source.iter_full())
    assert [name for name, _ in pairs] == [meta.name for meta in declared] == [name for name, _ in source]
    for (name, tensor), meta in zip(pairs, declared):
        assert tuple(tensor.shape) == tuple(meta.shape), name
    assert [name for group in source.groups() for name in group] == [meta.name for meta in declared]
    if VLLM_033:  # what 0.33's NCCL and IPC trainer engines check at trainer_init
        assert source.implements_iter_full()
        assert source.owned_names(0) == [meta.name for meta in declared]
        assert all(meta.owners is None for meta in declared)


def test_engine_weights_for_vllms_engines_convert_to_its_dtypes_on_the_way():
    module = ModuleWeights(tiny_qwen2())
    engine_metadata = {meta.name: (torch.bfloat16, meta.shape) for meta in module.metadata}
    # vLLM's engines send the bytes they are given, and 0.33's NCCL engine checks each tensor's dtype.
    converted = EngineWeights(module, engine_metadata, device=torch.device("cpu"))
    assert {tensor.dtype for _, tensor in converted} == {torch.bfloat16}
    assert {tensor.dtype for _, tensor in EngineWeights(module, engine_metadata)} == {
        torch.float32
    }  # gloo converts itself


def test_declared_weights_declare_and_refuse_to_be_read():
    source = DeclaredWeights({"lm_head.weight": (torch.float32, torch.Size([2, 3]))})
    assert source.metadata == [ParamMeta("lm_head.weight", torch.float32, (2, 3))]
    with pytest.raises(RuntimeError, match="holds no tensors"):
        next(source.iter_full())


def test_a_source_written_for_the_installed_api_is_read_through_it():
    tensors = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(2, 3)}
    params = [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    if VLLM_033:

        class UserSource(WeightSource):
            @cached_property
            def metadata(self):
                return params

            def iter_full(self):
                return iter(tensors.items())

    else:

        class UserSource(WeightSource):  # type: ignore[no-redef]
            def metadata(self):
                return params

            def __iter__(self):
                return iter(tensors.items())

    source = weights_from(UserSource())
    assert source.metadata == params
    assert [name for name, _ in source] == list(tensors)


def test_a_write_changes_the_stamp_and_a_read_does_not():
    weight = torch.zeros(3)
    before = tensor_stamp(weight)
    _ = weight.sum(), weight.clone()
    assert same_stamp((before,), (tensor_stamp(weight),))
    weight.add_(1)
    assert not same_stamp((before,), (tensor_stamp(weight),))


def test_a_freed_tensor_never_passes_for_a_new_one_in_its_memory():
    stamp = tensor_stamp(torch.zeros(1024))
    assert not same_stamp((stamp,), (tensor_stamp(torch.zeros(1024)),))  # freed: its stamp matches nothing


def test_an_optimizer_step_changes_trained_parameters_only():
    model = tiny_qwen2(seed=0)
    model.model.embed_tokens.weight.requires_grad_(False)
    source = ModuleWeights(model)
    before = source.stamps()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, 512, (2, 8))
    with torch.enable_grad():  # (whatever an earlier test left set)
        model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    after = source.stamps()
    assert before is not None and after is not None
    unchanged = {name for name in after if same_stamp(before[name], after[name])}
    assert unchanged == {"model.embed_tokens.weight"}
    assert unchanged_names(source.groups(), after, before) == {"model.embed_tokens.weight"}


def test_one_written_tensor_sends_its_whole_layer_group():
    model = tiny_qwen2(seed=0)
    source = ModuleWeights(model)
    sent = SentStamps()
    assert sent.unchanged(source.groups(), source.stamps()) == set()  # nothing sent yet: all of it
    sent.record([meta.name for meta in source.metadata()], source.stamps())
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.mul_(2)
    unchanged = sent.unchanged(source.groups(), source.stamps())
    layer_1 = {name for name, _ in model.named_parameters() if name.startswith("model.layers.1.")}
    assert unchanged == {name for name, _ in model.named_parameters()} - layer_1
    sent.record(layer_1, source.stamps())
    assert len(sent.unchanged(source.groups(), source.stamps())) == len(list(model.parameters()))
    sent.record([], None)  # a push without stamps (an adapter, a sharded policy): what the engine holds is unknown
    assert sent.unchanged(source.groups(), source.stamps()) == set()


def test_merged_lora_weights_change_with_their_adapter():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_qwen2(seed=0), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    source = weights_from(policy)
    before = source.stamps()
    with torch.no_grad():
        policy.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(1)
    after = source.stamps()
    assert before is not None and after is not None
    changed = {name for name in after if not same_stamp(before[name], after[name])}
    assert changed == {"model.layers.0.self_attn.q_proj.weight"}


def test_dicts_of_live_tensors_are_stamped():
    weight = torch.zeros(2)
    assert MappingWeights({"w": weight}).stamps() is not None


def test_a_merged_lora_source_read_part_way_leaves_grad_mode_alone():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_qwen2(seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    tensors = iter(weights_from(policy))
    next(tensors)  # a reader that stops early (the tied-embedding check does)
    assert torch.is_grad_enabled()
