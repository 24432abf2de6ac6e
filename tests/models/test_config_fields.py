"""A misspelt field given to any family's preset (`XConfig.preset("tiny", num_layer=3)`) is a ValueError naming it,
with the closest field names and every field, before anything is built (`--set`'s: tests/train/test_cli.py)."""
from __future__ import annotations

import dataclasses

import pytest

from zoo.models import registry


@pytest.mark.parametrize("name", sorted(registry.FAMILIES))
def test_an_unknown_field_of_a_preset_names_it_and_the_close_fields(name):
    cls = registry.FAMILIES[name].config_cls
    fields = {f.name for f in dataclasses.fields(cls)}
    with pytest.raises(ValueError, match=rf"'num_layer' is not a field of {cls.__name__} \(did you mean "
                                         r"num_layers[ ?].*; its fields: ") as e:
        cls.preset("tiny", num_layer=3)
    assert all(f in str(e.value) for f in fields)
    with pytest.raises(ValueError, match=r"'num_layer' \(did you mean num_layers[ ?].*, 'zzz' are not fields"):
        cls.preset("tiny", num_layer=3, zzz=1)
    assert cls.preset("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match=r"'num_layer' is not a field .* \(did you mean num_layers"):
        registry.FAMILIES[name].config("tiny", num_layer=3)
