"""What a module tree holds, found in one walk (FSDP1 units, LoRA layers, ZeRO-3 partitions, the parameters, the
modules); whether it is still so is ``weights/payload.TreeShape``'s (``tests/weights/test_payload.py``)."""

from __future__ import annotations

import torch
from helpers import lora_policy, tiny_qwen2
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_vllm.weights.survey import Survey, survey


def test_a_plain_model_holds_none_of_them_and_its_parameters_are_listed_as_named_parameters_lists_them():
    model = tiny_qwen2()
    assert survey(model) == Survey(False, False, False)
    assert [(name, id(param)) for name, param in survey(model).parameters] == [
        (name, id(param)) for name, param in model.named_parameters()
    ]
    tied = tiny_qwen2(tie_word_embeddings=True)  # a parameter held twice is listed once, as named_parameters does
    assert [name for name, _ in survey(tied).parameters] == [name for name, _ in tied.named_parameters()]


def test_lora_layers_are_found_inside_a_peft_model_and_around_it():
    policy = lora_policy()
    assert survey(policy) == Survey(False, True, False)
    holder = torch.nn.ModuleDict({"policy": policy, "head": torch.nn.Linear(2, 2)})
    assert survey(holder).lora_layers and not survey(holder["head"]).lora_layers


def test_a_zero3_partitioned_parameter_is_found_by_its_ds_id():
    model = tiny_qwen2()
    model.model.layers[1].mlp.up_proj.weight.ds_id = 7  # what DeepSpeed's ZeRO-3 sets on each parameter it owns
    assert survey(model) == Survey(False, False, True)


def test_an_fsdp1_unit_is_found_by_its_type_at_any_depth():
    # Its type is what is asked: an unwrapped instance (no process group here) stands in the tree.
    unit = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(unit)
    tree = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(unit))
    assert survey(tree) == Survey(True, False, False)
    assert survey(unit).fsdp_units


def test_the_survey_lists_every_module_once_in_the_trees_order():
    model = tiny_qwen2()
    model.model.layers[1].mlp.shared = model.model.layers[0].mlp  # a module in the tree twice
    assert survey(model).modules == list(model.modules())
