"""The model families: what every front end (training, planning, `from_hf`/`to_hf`, the benchmarks) may ask of a
model family, and the table the families register into.

A family is a package under `zoo/models/<family>/` that builds one `Family` record and calls `register` when it is
imported; `zoo/models/__init__.py` imports each family package (one line per family). Generic code asks only what
the record (and `LMConfig`'s hooks: `attention_head_dim`, `kernel_choices`, `mesh_divisors`) answers, never a
family's fields by name:

    family("llama3").config("llama3_1_405b", num_layers=4)   # a preset with overrides
    family_of(cfg).build(cfg, recipe=..., rngs=...)
    family_for_hf(config_json).hf.from_hf(config_json, param_dtype="bfloat16")

Recipes are the application's (`recipes/<family name>.py`): nothing here names them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.config import LMConfig


def no_aux_loss(cfg: LMConfig, aux: dict) -> jax.Array:
    return jnp.zeros((), jnp.float32)


def no_update(model: nnx.Module, aux: dict) -> None:
    return None


def no_extra_keys(hf: dict) -> Callable[[str], bool]:
    return lambda key: False


@dataclasses.dataclass(frozen=True)
class HFArch:
    """How a family maps to a Hugging Face architecture (read by zoo.hf.load, written by zoo.hf.save)."""
    architecture: str                                       # config.json "architectures"
    model_type: str                                         # config.json "model_type"
    from_hf: Callable[..., LMConfig]                        # (hf config dict, param_dtype=) -> config
    to_hf: Callable[[LMConfig], dict]                       # config -> hf config dict
    keys: Callable[[LMConfig], list]                        # config -> [zoo.hf.keymap.Entry]
    extra_keys: Callable[[dict], Callable[[str], bool]] = no_extra_keys  # checkpoint keys the zoo skips


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config class (whose `PRESETS` table names its sizes), its builder, its Hugging Face
    mapping, its FLOP count and its training-time hooks."""
    name: str                                               # --model; recipes/<name>.py holds its recipes
    config_cls: type[LMConfig]
    build: Callable[..., nnx.Module]                        # build(cfg, recipe=, rngs=)
    hf: HFArch
    flops_per_token: Callable[[Any, nnx.Module, int], float]  # (cfg, model, seq) -> training FLOPs per token
    aux_loss: Callable[[Any, dict], jax.Array] = no_aux_loss      # (cfg, aux) -> scalar added to the loss
    after_update: Callable[[nnx.Module, dict], None] = no_update  # (model, aux): state updates after the step

    def presets(self) -> tuple[str, ...]:
        return self.config_cls.presets()

    def config(self, preset: str, **overrides) -> LMConfig:
        """The preset `preset` with `overrides` replacing fields (values of the fields' types)."""
        if preset not in self.presets():
            raise ValueError(f"preset {preset!r} is not a {self.name} preset; choose one of: "
                             f"{', '.join(self.presets())}")
        return self.config_cls.preset(preset, **overrides)   # a misspelt field: ValueError with the close names


FAMILIES: dict[str, Family] = {}


def register(f: Family) -> Family:
    """Add a family to the table (a family package calls this once, when imported)."""
    if f.name in FAMILIES and FAMILIES[f.name] is not f:
        raise ValueError(f"model family {f.name!r} is registered twice")
    taken = {g.hf.architecture: g.name for g in FAMILIES.values() if g.name != f.name}
    if f.hf.architecture in taken:
        raise ValueError(f"{f.name}: Hugging Face architecture {f.hf.architecture!r} is already "
                         f"{taken[f.hf.architecture]}'s")
    FAMILIES[f.name] = f
    return f


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model {name!r} is not in the zoo; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(cfg: Any) -> Family:
    """The family of a config (or of a model, through its `config`)."""
    cfg = getattr(cfg, "config", cfg)
    for f in FAMILIES.values():
        if isinstance(cfg, f.config_cls):
            return f
    raise ValueError(f"no model family for a {type(cfg).__name__}; the zoo has: "
                     f"{', '.join(f.config_cls.__name__ for f in FAMILIES.values())}")


def family_for_hf(hf: dict) -> Family:
    """The family of a Hugging Face config.json (by `architectures`, else `model_type`)."""
    names = hf.get("architectures") or []
    by_type = {f.hf.model_type: f.hf.architecture for f in FAMILIES.values()}
    if not names and hf.get("model_type") in by_type:
        names = [by_type[hf["model_type"]]]
    for f in FAMILIES.values():
        if f.hf.architecture in names:
            return f
    raise ValueError(f"config.json: architectures={names!r} (model_type={hf.get('model_type')!r}) is not supported; "
                     f"zoo reads {sorted(f.hf.architecture for f in FAMILIES.values())}")


def config(name: str, preset: str, **overrides) -> LMConfig:
    """`family(name).config(preset, **overrides)`."""
    return family(name).config(preset, **overrides)
