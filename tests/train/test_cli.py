"""`--set FIELD=VALUE` (recipes.train.settings.cli): the text becomes the field's type, for every family's fields (the
MTP fields of DeepSeek-V3 too); junk, or a field that does not exist, is a ValueError naming the flag, the field and the
type or the closest field names (a misspelt field given to a preset in Python: tests/models/test_config_fields.py)."""
from __future__ import annotations

import pytest

import zoo
from recipes.train.settings import cli
from recipes.train.settings.cli import parse_field


def test_set_values_parse_to_the_field_type():
    """`--set FIELD=VALUE` text becomes the field's type; junk is a ValueError naming the field and the type."""
    cls = zoo.models.LlamaConfig
    assert parse_field(cls, "tie_embeddings", "false") is False and parse_field(cls, "tie_embeddings", "True") is True
    assert parse_field(cls, "num_layers", "3") == 3 and parse_field(cls, "rope_theta", "1e4") == 10000.0
    assert parse_field(cls, "attention_impl", "none") is None and parse_field(cls, "dtype", "float32") == "float32"
    for field, text, match in [("tie_embeddings", "maybe", "tie_embeddings must be a bool, got 'maybe'"),
                               ("num_layers", "2.5", "num_layers must be an int"),
                               ("norm_eps", "nan", "norm_eps must be a finite number"),
                               ("num_layer", "3", "'num_layer' is not a field of LlamaConfig")]:
        with pytest.raises(ValueError, match=match):
            parse_field(cls, field, text)


def test_set_accepts_the_mtp_fields():
    cls = zoo.models.DeepSeekV3Config
    assert parse_field(cls, "mtp_depths", "1") == 1 and parse_field(cls, "mtp_lambda", "0.1") == 0.1


def test_set_with_an_unknown_field_names_the_flag_and_the_close_field():
    fam = cli.family("llama3")
    with pytest.raises(ValueError, match=r"--set num_layer=3: 'num_layer' is not a field of LlamaConfig \(did you "
                                         r"mean num_layers\?\)"):
        cli.model_config(fam, "tiny", [("num_layer", "3")])
