"""Training defaults per preset: the peak learning rate and the warm-up, from the published runs.

`--lr` and `--warmup` given on the command line always win. A family declares the published schedules of its
presets (`zoo.models.registry.Family.train_defaults`, in its package). The tiny preset keeps the CPU demo's 3e-3 (a
100k parameter model learns in 60 steps); a full-size preset with no published schedule gets 3e-4 and a 2000-step
warm-up (the common peak and warm-up of published 7-8B runs): the tiny rate made an 8B run's loss rise (12.27 ->
14.53, issue 11). The warm-up is a tenth of the schedule (at least one step), capped at the published warm-up, so
a short run warms up briefly and a long one as the paper did.

Dtypes (the configs' own defaults, kept): parameters in float32, activations in bf16 (`dtype`), softmax/norm
statistics and the loss in float32, AdamW moments in float32 (`--opt-dtype`): the usual mixed precision.
`--opt-dtype bfloat16` halves the optimizer state (moments kept in bf16 "without observable degradation" in a
published 671B run).
"""
from __future__ import annotations

DEFAULT_MODEL = "llama3"  # --model's default: the family of the README's main job

# (peak learning rate, warm-up cap, where from) of a preset its family publishes no schedule for
TINY = (3e-3, None, "the CPU demo (README's main job)")
FULL_SIZE = (3e-4, 2000, "a full-size default: the common 3e-4 peak and 2000 warm-up steps of published 7-8B runs")


def for_preset(model: str, preset: str):
    """The preset's `zoo.models.registry.TrainDefaults`: what its family publishes for it, else `TINY` for the
    tiny preset, else `FULL_SIZE`. Imports the library (JAX) when called, not when this module is imported."""
    from recipes.train.settings.cli import family
    from zoo.models.registry import TrainDefaults
    published = family(model).train_defaults.get(preset)
    return published if published is not None else TrainDefaults(*(TINY if preset == "tiny" else FULL_SIZE))


def warmup(model: str, preset: str, schedule_steps: int) -> int:
    """A tenth of the schedule, at least 1, at most the published warm-up."""
    steps = max(1, schedule_steps // 10)
    cap = for_preset(model, preset).warmup_cap
    return steps if cap is None else min(steps, cap)
