"""The model part of the key namespace follows the weights, not the path."""

from __future__ import annotations

import json
import shutil

import huggingface_hub

from maru.cli._tiny_model import build_tiny_llama
from maru.vllm.identity import model_identity


def test_a_copy_of_the_weights_elsewhere_is_the_same_model(tiny_model, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert model_identity(str(copy)) == model_identity(str(tiny_model))
    assert model_identity(str(tiny_model)).startswith("weights:")


def test_other_weights_at_the_same_path_are_another_model(tiny_model, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    before = model_identity(str(copy))
    sizes = sorted(p.stat().st_size for p in copy.glob("*.safetensors"))
    build_tiny_llama(copy, seed=1)
    assert sorted(p.stat().st_size for p in copy.glob("*.safetensors")) == sizes, (
        "same file names and sizes: only the bytes differ"
    )
    assert model_identity(str(copy)) != before


def test_a_config_change_is_another_model(tiny_model, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (copy / "config.json").write_text(json.dumps(config))
    assert model_identity(str(copy)) != model_identity(str(tiny_model))


def test_a_symlink_is_the_model_it_points_to(tiny_model, tmp_path) -> None:
    other = build_tiny_llama(tmp_path / "other", seed=1)
    latest = tmp_path / "latest"
    latest.symlink_to(tiny_model)
    first = model_identity(str(latest))
    latest.unlink()
    latest.symlink_to(other)
    assert model_identity(str(latest)) == model_identity(str(other)) != first


def test_a_hub_model_not_in_the_cache_is_named_by_id_and_revision(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_identity("nobody/no-such-model", "v1") == "name:nobody/no-such-model@v1"


def test_a_cached_hub_model_is_named_by_its_weights(tiny_model, tmp_path, monkeypatch) -> None:
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model, snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_identity("org/tiny") == model_identity(str(tiny_model))
