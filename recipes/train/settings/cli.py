"""Command-line pieces shared by `python -m recipes.train` and `python -m recipes.train.plan`: flags generated from a
dataclass's fields (`add_fields`: `recipes.train.settings.config.RunConfig` holds each default and help text once), the
argparse types that check them, and the look-ups of the model (`--model FAMILY --preset NAME --set FIELD=VALUE`) and the
recipe (`model_and_recipe`: both, checked to fit each other).

Importing this module imports no JAX (the training command applies its XLA flags first); the functions that
read the model table (`family`, `model_config`, `recipe`, `model_and_recipe`) import it when called.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, saying no as both commands do: a bad flag or value is one line on stderr naming it and
    the fix, and exit 2; the usage block only for `--help`."""

    def error(self, message: str):
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            from zoo.names import did_you_mean  # imports JAX: only once the command is refused
            flags = [s for a in self._actions for s in a.option_strings]
            typed = [f.split("=")[0] for f in unknown.split() if f.startswith("--")]
            message += next((hint for hint in (did_you_mean(f, flags) for f in typed) if hint), "")
            message += f"; `{self.prog} --help` lists the flags"
        self.exit(2, f"error: {message}\n")


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
# The planner's Python arguments, as its messages name them (`zoo.plan`), and the flags of `recipes.train.plan`.
ARGUMENT_FLAGS = ((re.compile(r"\bpeak=(['\"])(\w+)\1"), r"--peak \2"), (re.compile(r"\bhbm_gib\b"), "--hbm"))


def in_flags(text: str) -> str:
    """`text` from `zoo.plan` with each Python argument it names as the planner's flag (`peak='compile'` ->
    `--peak compile`, `hbm_gib` -> `--hbm`)."""
    for pattern, flag in ARGUMENT_FLAGS:
        text = pattern.sub(flag, text)
    return text


def console(**kwargs):
    """A rich Console for a command's tables: the terminal's width on a terminal; piped or redirected (a log, `| less`),
    wide enough that tables print at their natural width and no line wraps (`zoo.plan.report.new_console`; this
    imports JAX)."""
    from zoo.plan.report import new_console
    return new_console(**kwargs)


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


def add_fields(p: argparse.ArgumentParser, cls, names: tuple[str, ...] | None = None, **changes: dict) -> None:
    """Add a flag to `p` for each field of the dataclass `cls` (those in `names`, in that order; default: every
    field, in its order) from the field itself: its default, its type (int and float are parsed as such, a bool
    field is a switch) and its metadata (`recipes.train.settings.config.flag`: the flag names, help, metavar, choices, a
    checking type). `changes[field]` replaces argparse keywords for one command (e.g. the planner's own help text)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names or tuple(fields):
        f = fields[name]
        kwargs = {"default": f.default, **f.metadata, **changes.get(name, {})}
        opts = kwargs.pop("flags", None) or ("--" + name.replace("_", "-"),)
        kind = _scalar(hints[name])
        if kwargs.get("action") == "append":
            kwargs["default"] = list(kwargs["default"])
        elif kind is bool:
            kwargs["action"] = "store_true"
        elif kind in (int, float) and "choices" not in kwargs:
            kwargs.setdefault("type", kind)
        p.add_argument(*opts, dest=name, **kwargs)


def _scalar(hint):
    """`int | None` -> int; a type that is not a union, as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if isinstance(hint, types.UnionType) and len(args) == 1 else hint


def family(name: str):
    """The model table's family `name`; ValueError naming --model."""
    from zoo.models import registry
    from zoo.names import did_you_mean
    if name not in registry.FAMILIES:
        raise ValueError(f"--model {name!r} is not in the zoo{did_you_mean(name, registry.FAMILIES)}; choose one of: "
                         f"{', '.join(registry.FAMILIES)}")
    return registry.FAMILIES[name]


def parse_field(cls: type, name: str, text: str):
    """Command-line text for the field `name` of the config class `cls`, as that field's type (read from its
    annotation: `zoo.models.fields.field_types`): "false" -> False for a bool, "3" -> 3 for an int, "none" -> None
    where None is allowed. ValueError naming the field and its type otherwise. The config checks the value itself
    when it is made."""
    from zoo.models.fields import check_field_names, field_types, type_name, type_options
    types_ = field_types(cls)
    if name not in types_:
        check_field_names(cls, [name])   # names the field, a close match and every field
    allowed, optional = type_options(types_[name])
    low = text.strip().lower()
    if optional and low in ("none", "null"):
        return None
    for t in allowed:
        if t is bool and low in ("true", "false", "1", "0", "yes", "no"):
            return low in ("true", "1", "yes")
        if t is int:
            try:
                return int(text)
            except ValueError:
                pass
        if t is float:
            try:
                value = float(text)
            except ValueError:
                continue
            if math.isfinite(value):
                return value
        if t is str:
            return text
    raise ValueError(f"{cls.__name__}.{name} must be {type_name(allowed, optional)}, got {text!r}")


def model_config(fam, preset: str, overrides=()):
    """The family's preset with `overrides` ((FIELD, VALUE) pairs): text values are converted to the field's type
    (`parse_field`: "false" -> False for a bool field), others are used as given."""
    if preset not in fam.presets():
        from zoo.names import did_you_mean
        raise ValueError(f"--preset {preset!r} is not a {fam.name} preset{did_you_mean(preset, fam.presets())}; "
                         f"choose one of: {', '.join(fam.presets())}")
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


def model_and_recipe(model: str, preset: str, overrides, recipe_name: str | None, seq: int):
    """(family, model config, recipe name, recipe) of `--model`, `--preset`, `--set` and `--recipe` (None: the
    family's default; "auto": no recipe yet, it is chosen once the step's shapes are known), looked up and checked
    to fit each other at `--seq` (`check_recipe_fits`): ValueError naming the flag and the fix."""
    from recipes import registry
    fam = family(model)
    recipe_name = recipe_name or registry.default_recipe(fam)
    chosen = None if recipe_name == "auto" else registry.recipe(fam, recipe_name)
    model_cfg = model_config(fam, preset, overrides)
    try:
        model_cfg.check_seq(seq)
    except ValueError as e:
        raise ValueError(f"--seq {seq}: {e}") from None
    if chosen is not None:
        check_recipe_fits(fam, chosen, recipe_name, model_cfg, seq)
    return fam, model_cfg, recipe_name, chosen


def recipe(fam, name: str | None):
    """The family's recipe `name` (None: its default); ValueError naming --recipe."""
    from recipes import registry
    return registry.recipe(fam, name)


def check_recipe_fits(fam, recipe, name: str, model_cfg, seq: int) -> None:
    """ValueError, in the flags the user typed, before anything compiles, when the recipe's structure does not fit:
    its sequence tiles do not divide --seq (the nearest lengths that do, and a recipe without tiles, offered), or
    its group does not divide a stack's layers (a recipe without groups offered)."""
    from recipes import registry
    from zoo.plan.measure import abstract_model
    others = registry.recipes_of(fam)
    tiles, group = recipe.seq_tiles, recipe.group

    def instead(field: str) -> str:
        """The family's recipe without tiles (or groups) nearest this one: the same placements, else the same other
        structure and the most tags placed alike."""
        mine = set(recipe.offload + recipe.device)
        other = "group" if field == "seq_tiles" else "seq_tiles"
        plain = [r for r in others.values() if getattr(r, field) == 1 and r.special is None]
        if not plain:
            return "a recipe"
        best = max(plain, key=lambda r: ((r.offload, r.device) == (recipe.offload, recipe.device),
                                         getattr(r, other) == getattr(recipe, other), len(mine & {*r.offload,
                                                                                                   *r.device})))
        same = (best.offload, best.device) == (recipe.offload, recipe.device)
        return f"--recipe {best.name}" + (" (the same placements)" if same else "")

    if tiles > 1 and seq % tiles:
        below, above = seq // tiles * tiles, (seq // tiles + 1) * tiles
        fits = [n for n in (below, above) if n > 0 and (model_cfg.max_seq_len is None or n <= model_cfg.max_seq_len)]
        raise ValueError(f"--recipe {name} cuts the sequence into {tiles} tiles and --seq {seq} is not a multiple of "
                         f"{tiles}: give {' or '.join(f'--seq {n}' for n in fits)}, or {instead('seq_tiles')} "
                         f"without tiles")
    if group > 1:
        model = abstract_model(model_cfg)
        for stack in model.stack_names:
            layers = getattr(model, stack).num_layers
            if layers % group:
                near = (n for n in (layers // group * group, layers // group * group + group) if n)
                fix = (" or ".join(f"--set num_layers={n}" for n in near)
                       if len(model.stack_names) == 1 and layers == getattr(model_cfg, "num_layers", None) else
                       f"stacks of a multiple of {group} layers (--set)")
                raise ValueError(f"--recipe {name} recomputes the layers in groups of {group} and the stack {stack!r} "
                                 f"has {layers} layers, not a multiple of {group}: give {instead('group')} without "
                                 f"groups, or {fix}")
