"""Training defaults per preset: the peak learning rate and the warm-up, from the published runs.

`--lr` and `--warmup` given on the command line always win. The tiny preset keeps the CPU demo's 3e-3 (a 100k
parameter model learns in 60 steps). A full-size preset gets its published peak rate: the tiny rate made the 8B
run's loss rise (12.27 -> 14.53, issue 11). The warm-up is a tenth of the schedule (at least one step), capped at
the published warm-up, so a short run warms up briefly and a long one as the paper did.

Dtypes (the configs' own defaults, kept): parameters in float32, activations in bf16 (`dtype`), softmax/norm
statistics and the loss in float32, AdamW moments in float32 (`--opt-dtype`): the mixed precision of MaxText and
the Llama 3 runs. DeepSeek-V3 kept its AdamW moments in bf16 "without observable degradation" (its report, 3.3.3):
`--opt-dtype bfloat16` halves the optimizer state.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainDefaults:
    lr: float                      # peak learning rate
    warmup_cap: int | None         # published warm-up steps (None: no cap)
    source: str


TINY = TrainDefaults(3e-3, None, "the CPU demo (README's main job)")
FULL_SIZE = TrainDefaults(3e-4, 2000, "a full-size default: Llama 3 8B's peak rate, Llama 2's 2000 warm-up steps")
PRESETS: dict[str, TrainDefaults] = {
    "tiny": TINY,
    "llama3_1_8b": TrainDefaults(3e-4, 2000, "Llama 3 paper, Table 3 (8B: 3e-4); warm-up as Llama 2 (2000)"),
    "llama3_1_70b": TrainDefaults(1.5e-4, 2000, "Llama 3 paper, Table 3 (70B: 1.5e-4); warm-up as Llama 2 (2000)"),
    "llama3_1_405b": TrainDefaults(8e-5, 8000, "Llama 3 paper, 3.4.1: peak 8e-5, linear warm-up of 8000 steps"),
    "deepseek_v3_671b": TrainDefaults(2.2e-4, 2000, "DeepSeek-V3 report, 4.2: 0 -> 2.2e-4 over the first 2K steps"),
}


def for_preset(preset: str) -> TrainDefaults:
    """The preset's defaults; a full-size preset not listed gets `FULL_SIZE`."""
    return PRESETS.get(preset, FULL_SIZE)


def warmup(preset: str, schedule_steps: int) -> int:
    """A tenth of the schedule, at least 1, at most the published warm-up."""
    steps = max(1, schedule_steps // 10)
    cap = for_preset(preset).warmup_cap
    return steps if cap is None else min(steps, cap)
