import pytest
import torch
from helpers import fake_hub_cache, save_model, tiny_qwen2

from lightning_vllm.errors import WeightsMismatchError
from lightning_vllm.weights import ModuleWeights, check_weights, checkpoint_weights, metadata_problems, source_metadata
from lightning_vllm.weights.checks import config_weights, engine_weights

F32, BF16 = torch.float32, torch.bfloat16


def test_the_checkpoint_gives_names_shapes_and_the_serving_dtype(tmp_path):
    model = tiny_qwen2()
    expected = checkpoint_weights(save_model(model, tmp_path), serving_dtype=BF16, ties_word_embeddings=False)
    assert expected is not None
    assert expected.weights.keys() == source_metadata(ModuleWeights(model)).keys()
    assert expected.weights["lm_head.weight"] == (BF16, torch.Size([512, 128]))


def test_a_tied_model_loads_no_output_embedding(tmp_path):
    model = tiny_qwen2(tie_word_embeddings=True)
    expected = checkpoint_weights(save_model(model, tmp_path), serving_dtype=F32, ties_word_embeddings=True)
    assert expected is not None and expected.ties_word_embeddings
    assert "lm_head.weight" not in expected.weights and "model.embed_tokens.weight" in expected.weights


def test_no_local_checkpoint_means_unknown(tmp_path):
    assert checkpoint_weights(tmp_path, serving_dtype=F32, ties_word_embeddings=False) is None
    assert checkpoint_weights("Qwen/Qwen2-0.5B", serving_dtype=F32, ties_word_embeddings=False) is None


def test_an_engine_started_from_a_hub_id_is_checked_against_the_cached_checkpoint(tmp_path, monkeypatch):
    model = tiny_qwen2()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (nothing may be fetched)
    cache = fake_hub_cache(tmp_path / "hub", "org/tiny", model=model)
    expected = engine_weights("org/tiny", serving_dtype=BF16, ties_word_embeddings=False, download_dir=str(cache))
    assert expected is not None and expected.weights["lm_head.weight"] == (BF16, torch.Size([512, 128]))
    assert expected.weights.keys() == source_metadata(ModuleWeights(model)).keys()
    assert engine_weights("org/absent", serving_dtype=BF16, ties_word_embeddings=False, download_dir=str(cache)) is None


@pytest.mark.parametrize("tied", [False, True])
def test_an_engine_with_no_checkpoint_is_checked_against_its_config(tmp_path, tied):
    # load_format="dummy" from a folder holding only config.json, as RL stacks start engines the first push fills
    model = tiny_qwen2(tie_word_embeddings=tied)
    model.config.save_pretrained(tmp_path)
    expected = engine_weights(str(tmp_path), serving_dtype=BF16, ties_word_embeddings=tied, hf_config=model.config)
    saved = checkpoint_weights(save_model(model, tmp_path / "saved"), serving_dtype=BF16, ties_word_embeddings=tied)
    assert expected is not None and saved is not None
    assert expected == saved  # the same names, shapes, serving dtypes and tying as the checkpoint's
    assert engine_weights(str(tmp_path), serving_dtype=BF16, ties_word_embeddings=tied) is None  # (no config given)


def test_a_config_transformers_cannot_build_is_not_checked():
    from transformers import PretrainedConfig

    unknown = PretrainedConfig(architectures=["NoSuchModel"], model_type="no_such_model")
    assert config_weights(unknown, serving_dtype=F32, ties_word_embeddings=False) is None


EXPECTED = {"a": (BF16, torch.Size([2, 2])), "b": (BF16, torch.Size([3]))}


@pytest.mark.parametrize(
    ("actual", "problem"),
    [
        ({"a": (F32, (2, 2)), "b": (F32, (3,)), "c": (F32, (1,))}, "unknown tensor 'c'"),
        ({"a": (F32, (2, 2))}, "missing tensor 'b'"),
        ({"a": (F32, (2, 3)), "b": (F32, (3,))}, "tensor 'a' has shape (2, 3), the engine's has (2, 2)"),
        (
            {"a": (torch.int64, (2, 2)), "b": (F32, (3,))},
            "tensor 'a' has dtype torch.int64, which cannot be sent as torch.bfloat16",
        ),
    ],
)
def test_each_kind_of_problem_is_named(actual, problem):
    (found,) = metadata_problems(EXPECTED, actual)
    assert found.startswith(problem)


def test_one_error_lists_up_to_ten_problems_with_a_hint():
    expected = {f"w{i}": (F32, torch.Size([1])) for i in range(13)}
    with pytest.raises(WeightsMismatchError) as caught:
        check_weights(expected, {}, what="The weights pushed")
    message = str(caught.value)
    assert message.count("missing tensor") == 10 and "(and 3 more)" in message
    assert message.startswith("The weights pushed do not fit the engine's model (13 problem(s)); nothing was sent")
    assert isinstance(caught.value, ValueError)


def test_hints_name_tied_embeddings_and_prefixes():
    expected = {"model.embed_tokens.weight": (F32, torch.Size([4, 2])), "lm_head.weight": (F32, torch.Size([4, 2]))}
    with pytest.raises(WeightsMismatchError, match="ties its input and output embeddings"):
        check_weights(expected, {"model.embed_tokens.weight": (F32, (4, 2))}, what="The weights")
    prefixed = {f"policy.{name}": meta for name, meta in expected.items()}
    with pytest.raises(WeightsMismatchError, match="extra prefix.*model_attribute"):
        check_weights(expected, prefixed, what="The weights")
