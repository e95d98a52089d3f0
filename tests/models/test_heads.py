"""Heads and pooling read from a model directory (models/heads.py), as sentence-transformers writes them."""

from __future__ import annotations

import json

import pytest

from jobrunner.models.heads import label_names, pooling_config, split_architecture


def test_architecture_names_give_family_and_head():
    assert split_architecture("Qwen2ForSequenceClassification") == ("Qwen2ForCausalLM", "classifier")
    assert split_architecture("LlamaModel") == ("LlamaForCausalLM", "none")
    assert split_architecture("MistralForCausalLM") == ("MistralForCausalLM", "lm")


def _st_dir(path, pooling: dict | None, normalize: bool):
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def test_pooling_from_sentence_transformers_files(tmp_path):
    assert pooling_config(tmp_path)["pooling"] == "last"  # no modules.json: a decoder's last token
    (tmp_path / "a").mkdir()
    got = pooling_config(_st_dir(tmp_path / "a", {"pooling_mode_lasttoken": True}, normalize=True))
    assert (got["pooling"], got["normalize"], got["pooling_source"]) == ("last", True, "1_Pooling/config.json")
    (tmp_path / "b").mkdir()
    assert pooling_config(_st_dir(tmp_path / "b", {"pooling_mode_cls_token": True}, False))["pooling"] == "cls"
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: pooling_mode_max_tokens is not supported"):
        pooling_config(_st_dir(tmp_path / "c", {"pooling_mode_max_tokens": True}, False))


def test_label_names_follow_id2label():
    class Config:
        num_labels = 3
        id2label = {0: "neg", 2: "pos"}

    assert label_names(Config()) == ["neg", "LABEL_1", "pos"]
