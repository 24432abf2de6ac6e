"""The model families: what every front end (training, planning, `from_hf`/`to_hf`, the benchmarks) may ask of a model
family, and the table the families register into.

A family is a package under `zoo/models/<family>/` that builds one `Family` record and calls `register` when it is
imported. Generic code asks only what the record and `LMConfig`'s hooks answer, never a family's fields by name
(`family(name).config("tiny")`, `family_of(cfg).build(cfg, recipe=..., rngs=...)`, `family_for_hf(config_json)`).
Recipes are the application's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.config import LMConfig, MoEConfig
from zoo.names import did_you_mean


def no_aux_loss(cfg: LMConfig, aux: dict) -> jax.Array:
    return jnp.zeros((), jnp.float32)


def no_update(model: nnx.Module, aux: dict) -> None:
    return None


def no_extra_keys(hf: dict) -> Callable[[str], bool]:
    return lambda key: False


@dataclasses.dataclass(frozen=True)
class HFArch:
    """How a family maps to a Hugging Face architecture (read by zoo.hf.load, written by zoo.hf.save).

    Args:
        architecture: config.json's "architectures" entry.
        model_type: config.json's "model_type".
        from_hf: (hf config dict, param_dtype=) -> the family's config.
        to_hf: config -> hf config dict.
        keys: config -> the checkpoint's entries (`zoo.hf.keymap.Entry`).
        extra_keys: hf config -> whether a checkpoint key belongs to an extra head.

    Examples:
        >>> from zoo.models import registry
        >>> registry.family("llama3").hf.architecture
        'LlamaForCausalLM'
    """
    architecture: str                                       # config.json "architectures"
    model_type: str                                         # config.json "model_type"
    from_hf: Callable[..., LMConfig]                        # (hf config dict, param_dtype=) -> config
    to_hf: Callable[[LMConfig], dict]                       # config -> hf config dict
    keys: Callable[[LMConfig], list]                        # config -> [zoo.hf.keymap.Entry]
    # the keys of the model's extra heads (zoo.models.lm) in a checkpoint: skipped where the model has none
    extra_keys: Callable[[dict], Callable[[str], bool]] = no_extra_keys


@dataclasses.dataclass(frozen=True)
class StepRate:
    """How fast a training step of the family runs on a device, measured (read by the planner, zoo.plan.links).

    Args:
        device_kind: matched (case-insensitive substring) against `jax.Device.device_kind`.
        moe_backend: for a family with experts, the dispatch backend measured (None: any, or no experts).
        tflops: the rate at which a recipe's extra (recomputed) FLOPs add time, per device.
        overhead: the step's work that is not its model FLOPs, as a fraction of their time at that rate.
        date: when it was measured.
        source: where the measurement is recorded.

    Examples:
        >>> from zoo.models import registry
        >>> all(isinstance(r, registry.StepRate) for r in registry.family("llama3").step_rates)
        True
    """
    device_kind: str         # matched (case-insensitive substring) against jax.Device.device_kind
    moe_backend: str | None  # for a family with experts: the dispatch backend measured (None: any / no experts)
    tflops: float
    overhead: float
    date: str
    source: str


@dataclasses.dataclass(frozen=True)
class TrainDefaults:
    """A preset's published training schedule.

    Args:
        lr: the peak learning rate.
        warmup_cap: the warm-up steps (None: no published cap).
        source: where it is published.

    Examples:
        >>> from zoo.models import registry
        >>> registry.TrainDefaults(lr=3e-4, warmup_cap=2000, source="the paper").lr
        0.0003
    """
    lr: float
    warmup_cap: int | None
    source: str


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config class (whose `PRESETS` table names its sizes), its builder, its Hugging Face
    mapping, its FLOP count, its training-time hooks, and what was measured or published for it.
    A family's package registers one (`register`) when imported.

    Args:
        name: the family's name (the command's --model; recipes/<name>.py holds its recipes).
        config_cls: its config class.
        build: build(cfg, recipe=, rngs=) -> the model.
        hf: its Hugging Face mapping (`HFArch`).
        flops_per_token: (cfg, model, seq) -> the training FLOPs per token.
        aux_loss: (cfg, aux) -> the scalar added to the loss (the balance loss).
        after_update: (model, aux) -> None: state updates after the step (the routing bias).
        step_rates: measured step rates (`StepRate`), by device (and MoE backend).
        train_defaults: {preset: `TrainDefaults`} as published.

    Examples:
        >>> from zoo.models import registry
        >>> fam = registry.family("qwen3")
        >>> fam.config_cls.__name__, fam.build.__name__
        ('Qwen3Config', 'qwen3')
    """
    name: str                                               # --model; recipes/<name>.py holds its recipes
    config_cls: type[LMConfig]
    build: Callable[..., nnx.Module]                        # build(cfg, recipe=, rngs=)
    hf: HFArch
    flops_per_token: Callable[[Any, nnx.Module, int], float]  # (cfg, model, seq) -> training FLOPs per token
    aux_loss: Callable[[Any, dict], jax.Array] = no_aux_loss      # (cfg, aux) -> scalar added to the loss
    after_update: Callable[[nnx.Module, dict], None] = no_update  # (model, aux): state updates after the step
    step_rates: tuple[StepRate, ...] = ()                  # measured step rates, by device (and MoE backend)
    train_defaults: Mapping[str, TrainDefaults] = dataclasses.field(default_factory=dict)  # {preset: published}

    def presets(self) -> tuple[str, ...]:
        return self.config_cls.presets()

    def config(self, preset: str, **overrides) -> LMConfig:
        """The preset `preset` with `overrides` replacing fields (values of the fields' types)."""
        if preset not in self.presets():
            raise ValueError(f"preset {preset!r} is not a {self.name} preset{did_you_mean(preset, self.presets())}; "
                             f"choose one of: "
                             f"{', '.join(self.presets())}")
        return self.config_cls.preset(preset, **overrides)   # a misspelt field: ValueError with the close names

    def step_rate(self, device_kind: str | None, cfg: LMConfig) -> StepRate | None:
        """The measured step rate of `cfg` (this family's) on a device kind, for its MoE backend; None if none
        was measured there."""
        backend = cfg.moe_backend if isinstance(cfg, MoEConfig) else None
        for r in self.step_rates:
            if (device_kind and r.device_kind.lower() in device_kind.lower()
                    and (r.moe_backend is None or r.moe_backend == backend)):
                return r
        return None


FAMILIES: dict[str, Family] = {}


def register(f: Family) -> Family:
    """Add a family to the table (a family package calls this once, when imported). ValueError for a name or a
    Hugging Face architecture already taken, or training defaults for a preset the family does not have."""
    unknown = sorted(set(f.train_defaults) - set(f.presets()))
    if unknown:
        raise ValueError(f"{f.name}: training defaults for {unknown}, which are not its presets: "
                         f"{', '.join(f.presets())}")
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
        raise ValueError(f"model {name!r} is not in the zoo{did_you_mean(name, FAMILIES)}; choose one of: "
                         f"{', '.join(FAMILIES)}")
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
    """The family of a Hugging Face config.json (by `architectures`, else `model_type`). ValueError naming both
    when they contradict each other (transformers goes by `model_type`: it would build another model)."""
    names = hf.get("architectures") or []
    by_type = {f.hf.model_type: f.hf.architecture for f in FAMILIES.values()}
    if not names and hf.get("model_type") in by_type:
        names = [by_type[hf["model_type"]]]
    for f in FAMILIES.values():
        if f.hf.architecture in names:
            said = hf.get("model_type")
            if said is not None and said != f.hf.model_type:
                builds = by_type.get(said, f"a {said!r} model")
                raise ValueError(f"config.json: architectures={names!r} names {f.hf.architecture}, whose model_type "
                                 f"is {f.hf.model_type!r}, but model_type={said!r}: transformers goes by model_type "
                                 f"and would build {builds} from it; correct the one that is wrong")
            return f
    raise ValueError(f"config.json: architectures={names!r} (model_type={hf.get('model_type')!r}) is not supported; "
                     f"zoo reads {sorted(f.hf.architecture for f in FAMILIES.values())}")


def config(name: str, preset: str, **overrides) -> LMConfig:
    """`family(name).config(preset, **overrides)`."""
    return family(name).config(preset, **overrides)
