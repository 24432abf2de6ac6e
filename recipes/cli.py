"""Command-line pieces shared by `python -m recipes.train` and `python -m recipes.plan`: one naming scheme for
the model (`--model FAMILY --preset CLASSMETHOD --set FIELD=VALUE`), the recipe and the shape (`--batch --seq`).

Importing this module imports no JAX (the training command applies its XLA flags first); the functions that
read the model table (`family`, `model_config`, `recipe`) import it when called.
"""
from __future__ import annotations

import argparse
import math


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help once, where there is a default worth showing and the help does not
    already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = not (action.default is None or action.default is False or action.default == []
                     or action.default == argparse.SUPPRESS)
        if "default" not in text and shown and action.option_strings and not action.required:
            text += " (default: %(default)s)"
        return text


INT32_MAX = 2**31 - 1


# The model and shape both command lines default to (`recipes.train` and `recipes.plan` share them).
DEFAULTS = {"preset": "tiny", "batch": 8, "seq": 64}


def _positive(cast: type, noun: str):
    """An argparse type: text -> a finite `cast` value > 0, or an error naming what was expected."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {noun}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a positive finite {noun}, got {text!r}")
        if cast is int and value > INT32_MAX:   # shapes and counts reach JAX as 32-bit integers
            raise argparse.ArgumentTypeError(f"expected a positive integer up to {INT32_MAX:,}, got {text!r}")
        return value
    parse.__name__ = f"positive_{cast.__name__}"
    return parse


positive_int = _positive(int, "integer")
positive_float = _positive(float, "number")


def field_override(text: str) -> tuple[str, str]:
    """FIELD=VALUE -> (FIELD, VALUE as text); the value is converted to the field's type once the model is known."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes FIELD=VALUE, got {text!r}")
    return key.strip(), value


def add_model_args(p: argparse.ArgumentParser, *, preset: str | None, batch: int | None, seq: int | None,
                   optional: tuple[str, ...] = ()) -> None:
    """--model, --preset, --set, --recipe, --batch, --seq. A None default makes the flag required, unless it is
    named in `optional` (the caller then checks it)."""
    p.add_argument("--model", default="llama3", metavar="FAMILY",
                   help="model family, a name in the zoo's model table (zoo.models.registry), e.g. llama3, "
                        "deepseek_v3")
    p.add_argument("--preset", default=preset, required=preset is None, metavar="NAME",
                   help="a config classmethod of the family, e.g. tiny, llama3_1_405b, deepseek_v3_671b")
    p.add_argument("--set", dest="overrides", type=field_override, action="append", default=[],
                   metavar="FIELD=VALUE", help="replace a config field, e.g. --set num_layers=3 or --set "
                   "tie_embeddings=false; the value is checked against the field's type (repeatable)")
    p.add_argument("--recipe", default=None, metavar="NAME",
                   help="a key of the family's RECIPES (recipes/<family>.py), or auto (the planner's choice for the "
                        "device; recipes.auto); default: the family's study recipe")
    for flag, default, what in (("--batch", batch, "global batch (sequences per step)"),
                                ("--seq", seq, "sequence length (tokens)")):
        p.add_argument(flag, type=positive_int, default=default, required=default is None and flag not in optional,
                       help=what)


def family(name: str):
    """The model table's family `name`; ValueError naming --model."""
    from zoo.models import registry
    if name not in registry.FAMILIES:
        raise ValueError(f"--model {name!r} is not in the zoo; choose one of: {', '.join(registry.FAMILIES)}")
    return registry.FAMILIES[name]


def model_config(fam, preset: str, overrides=()):
    """The family's preset with `overrides` ((FIELD, VALUE) pairs): text values are converted to the field's type
    (`zoo.models.config.parse_field`: "false" -> False for a bool field), others are used as given."""
    from zoo.models.config import parse_field
    if preset not in fam.presets():
        raise ValueError(f"--preset {preset!r} is not a {fam.name} preset; choose one of: {', '.join(fam.presets())}")
    values = {}
    for key, value in overrides:
        if isinstance(value, str):
            try:
                value = parse_field(fam.config_cls, key, value)
            except ValueError as e:
                raise ValueError(f"--set {key}={value}: {e}") from None
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT32_MAX:
            raise ValueError(f"--set {key}={value}: an integer field must be within +-{INT32_MAX:,} (JAX's int32)")
        values[key] = value
    try:
        return fam.config(preset, **values)
    except ValueError as e:
        raise ValueError(f"--set: {e}" if values else str(e)) from None


def recipe(fam, name: str | None):
    """The family's recipe `name` (None: its default); ValueError naming --recipe."""
    from recipes import registry
    return registry.recipe(fam, name)
