"""A push's choice and checks, kept for the next push of the same model while its module tree is as it was: the
same pushes land, and any change to the tree (a parameter replaced or resized, a module added) is chosen and
checked anew, before a byte moves."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import FakeEngine, tiny_moe, tiny_qwen2

from lightning_vllm import WeightsMismatchError, WeightSync
from lightning_vllm.options import UpdaterOptions
from lightning_vllm.weights import survey as survey_module
from lightning_vllm.weights.payload import TreeShape
from lightning_vllm.weights.survey import survey


@pytest.fixture
def surveys(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """Every module surveyed (a push that chose anew surveyed the model)."""
    surveyed: list[torch.nn.Module] = []
    original = survey_module.survey

    def counted(module: torch.nn.Module) -> survey_module.Survey:
        surveyed.append(module)
        return original(module)

    monkeypatch.setattr(survey_module, "survey", counted)
    return surveyed


def step(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():  # an optimizer step: in place
        for parameter in model.parameters():
            parameter.add_(by)


def test_pushes_of_an_unchanged_model_reuse_the_choice_and_land(surveys):
    model = tiny_qwen2(seed=21)
    engine = FakeEngine(model)
    sync = WeightSync(engine, options=UpdaterOptions(changed_only=False))
    sync.push(model)
    assert surveys == [model]
    for by in (0.1, 0.2):
        step(model, by)
        sync.push(model)
        assert engine.holds(model)
    assert surveys == [model]  # walked once
    sync.push(tiny_qwen2(seed=21))  # another object: chosen anew
    assert len(surveys) == 2


def test_a_moe_models_choice_is_kept_with_its_checkpoint_layout(surveys):
    model = tiny_moe("qwen3_moe", seed=23)
    engine = FakeEngine(model)
    sync = WeightSync(engine, options=UpdaterOptions(changed_only=False))
    sync.push(model)
    for by in (0.1, 0.2):
        step(model, by)
        sync.push(model)
        assert engine.holds(model)  # the experts one by one, as converted at the first push
    assert surveys == [model]  # walked once: the plan kept with the choice


def test_a_changed_only_push_of_a_kept_choice_still_leaves_out_what_did_not_change():
    model = tiny_qwen2(seed=22)
    engine = FakeEngine(model)
    sync = WeightSync(engine)  # changed_only=True: the stamps are read at every push
    sync.push(model)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    stats = sync.push(model)
    assert list(engine.weights) == ["model.norm.weight", "lm_head.weight"]  # the one group that changed
    assert torch.equal(engine.weights["model.norm.weight"], model.model.norm.weight)
    assert stats.num_bytes == (model.model.norm.weight.numel() + model.lm_head.weight.numel()) * 4


@pytest.mark.parametrize("change", ["parameter replaced", "data of another shape", "module added", "module removed"])
def test_a_changed_tree_is_chosen_and_checked_anew_before_a_byte_moves(change, surveys):
    model = tiny_qwen2(seed=23)
    engine = FakeEngine(model)
    sync = WeightSync(engine, options=UpdaterOptions(changed_only=False))
    sync.push(model)
    mlp = model.model.layers[0].mlp
    if change == "parameter replaced":  # the same shape: lands, from the new parameter
        mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.up_proj.weight))
    elif change == "data of another shape":
        mlp.up_proj.weight.data = torch.zeros(3, 3)
    elif change == "module added":  # a parameter the engine has no place for
        mlp.extra = torch.nn.Linear(2, 2)
    else:
        del model.model.layers[0].mlp._modules["up_proj"]  # (behind setattr's back)
    updates = engine.num_updates
    if change == "parameter replaced":
        sync.push(model)
        assert engine.holds(model)
    else:
        with pytest.raises(WeightsMismatchError):
            sync.push(model)
        assert engine.num_updates == updates  # nothing sent
    assert len(surveys) == 2


def test_a_model_pushed_once_and_dropped_is_freed():
    model = tiny_qwen2(seed=24)
    sync = WeightSync(FakeEngine(model), options=UpdaterOptions(changed_only=False))
    sync.push(model)
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None


def test_new_options_or_a_new_connection_check_anew(surveys):
    model = tiny_qwen2(seed=25)
    engine = FakeEngine(model)
    sync = WeightSync(engine, options=UpdaterOptions(changed_only=False))
    sync.push(model)
    sync.set_options(timeout_seconds=30.0)  # closes the groups: the next push joins and checks again
    sync.push(model)
    sync._engine_set.forget(0)  # as after a failed push: a new connection
    sync.push(model)
    assert len(surveys) == 3 and engine.holds(model)


def test_an_engine_that_cannot_be_reached_is_tried_once_per_push():
    from lightning_vllm import PartialPushError, WeightSyncError

    model = tiny_qwen2(seed=26)
    engines = [FakeEngine(model), FakeEngine(model)]
    sync = WeightSync(engines, options=UpdaterOptions(changed_only=False))
    sync.push(model)
    attempts = []

    def gone() -> str:
        attempts.append(1)
        raise WeightSyncError("engine 1 is restarting")

    engines[1].transfer_backend = gone  # type: ignore[method-assign]
    sync._engine_set.forget(1)  # as after a failed push: the next push joins it again
    with pytest.raises(PartialPushError, match="engine 1 is restarting"):
        sync.push(model)
    assert attempts == [1] and engines[0].holds(model)


def test_the_tree_shape_holds_until_anything_in_the_tree_is_added_removed_replaced_or_resized():
    def changes(model: torch.nn.Module) -> list:
        layer = model.model.layers[0]
        return [
            lambda: setattr(layer.mlp, "up_proj", torch.nn.Linear(2, 2)),  # a module replaced
            lambda: setattr(layer.mlp, "extra", torch.nn.Linear(2, 2)),  # added
            lambda: delattr(layer.mlp, "up_proj"),  # removed
            lambda: layer.mlp._modules.pop("down_proj"),  # removed behind setattr's back
            lambda: layer.mlp.up_proj._parameters.__setitem__("weight", torch.nn.Parameter(torch.zeros(2))),
            lambda: setattr(layer.mlp.up_proj.weight, "data", torch.zeros(3, 3)),  # resized in place
            lambda: setattr(layer.mlp.up_proj.weight, "data", layer.mlp.up_proj.weight.data.half()),  # retyped
            lambda: layer.mlp.up_proj.register_parameter("bias", torch.nn.Parameter(torch.zeros(2))),
        ]

    model = tiny_qwen2()
    shape = TreeShape.of(survey(model).modules)
    assert shape.holds()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)  # values change: the shape holds
    assert shape.holds()
    for position in range(len(changes(model))):
        changed = tiny_qwen2()
        shape = TreeShape.of(survey(changed).modules)
        changes(changed)[position]()
        assert not shape.holds(), position


def test_a_tree_shape_keeps_nothing_alive():
    model = tiny_qwen2()
    shape = TreeShape.of(survey(model).modules)
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None and not shape.holds()
