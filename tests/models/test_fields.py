"""zoo.models.fields on a config dataclass of its own (no family): each field's value against its annotation, unknown
names with the closest fields, the range checks, and the annotations' types the `--set` parser reads; every message
names the class and the field."""
from __future__ import annotations

import dataclasses
import math

import pytest

from zoo.models import fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cfg:
    layers: int = 2
    eps: float = 1e-5
    tied: bool = False
    name: str = "x"
    window: int | None = None

    def __post_init__(self):
        fields.check_types(self)


def test_the_annotations_types():
    assert fields.field_types(Cfg) == {"layers": int, "eps": float, "tied": bool, "name": str, "window": int | None}
    assert fields.type_options(int | None) == ((int,), True) and fields.type_options(float) == ((float,), False)
    assert fields.type_name((int,), True) == "an int or None" and fields.type_name((float,), False) == "a finite number"


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": True}, "Cfg.layers must be an int, got True"),        # a bool is no int
    ({"layers": 2.0}, "Cfg.layers must be an int, got 2.0"),
    ({"eps": math.inf}, "Cfg.eps must be a finite number, got inf"),
    ({"eps": False}, "Cfg.eps must be a finite number, got False"),
    ({"tied": 1}, "Cfg.tied must be a bool, got 1"),
    ({"name": 3}, "Cfg.name must be a string, got 3"),
    ({"window": "8"}, "Cfg.window must be an int or None, got '8'"),
])
def test_a_value_its_annotation_refuses_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cfg(**kwargs)


def test_values_the_annotations_allow():
    cfg = Cfg(layers=3, eps=1, tied=True, name="y", window=None)   # an int is a float's value
    assert cfg.eps == 1 and Cfg(window=4).window == 4


def test_unknown_names_with_the_closest_fields_and_every_field():
    fields.check_field_names(Cfg, ["layers", "eps"])   # known: nothing
    with pytest.raises(ValueError, match=r"^'layer' is not a field of Cfg \(did you mean layers\?\); its fields: "
                                         r"eps, layers, name, tied, window$"):
        fields.check_field_names(Cfg, ["layer"])
    with pytest.raises(ValueError, match=r"^'layer' \(did you mean layers\?\), 'zzz' are not fields of Cfg; its"):
        fields.check_field_names(Cfg, ["layer", "zzz", "eps"])


def test_the_range_checks():
    fields.check_positive(Cfg(layers=1), "layers")
    fields.check_non_negative(Cfg(eps=0.0), "eps")
    fields.check_positive_float(Cfg(eps=0.5), "eps")
    with pytest.raises(ValueError, match="Cfg.layers must be a positive int, got 0"):
        fields.check_positive(Cfg(layers=0), "layers")
    with pytest.raises(ValueError, match="Cfg.tied must be a positive int, got True"):
        fields.check_positive(Cfg(tied=True), "tied")
    with pytest.raises(ValueError, match="Cfg.eps must be non-negative, got -1"):
        fields.check_non_negative(Cfg(eps=-1.0), "eps")
    with pytest.raises(ValueError, match="Cfg.eps must be a positive number, got 0"):
        fields.check_positive_float(Cfg(eps=0.0), "eps")
    fields.check_divides(Cfg(layers=2, window=6), "layers", "window")
    with pytest.raises(ValueError, match="Cfg.layers=4 must divide window=6"):
        fields.check_divides(Cfg(layers=4, window=6), "layers", "window")
