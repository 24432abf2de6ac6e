"""What a training step keeps and how it updates (`Training`): the one group the step (`zoo.train_step`) and the
planner (`zoo.plan`, which re-exports it) both take.

    step = zoo.train_step.compile_abstract(family, cfg, recipe, batch=8, seq=4096,
                                           training=Training(optimizer="adamw", grad_accum=2, opt_state="host"))
"""
from __future__ import annotations

import dataclasses
import math

from zoo.checks import check_positive
from zoo.opt_state import OPT_STATE_PLACES, PARAMS_PLACES
from zoo.optim import OPTIMIZER_NAMES


@dataclasses.dataclass(frozen=True)
class Training:
    """What the step keeps and how it updates: `optimizer` (`zoo.optim.OPTIMIZER_NAMES`) with its moments in
    `opt_dtype`, on the "device" or in pinned "host" memory between steps (`opt_state`); `params="host"`: a float32
    master copy of 16-bit parameters in pinned host memory; `grad_accum` micro-batches per update; `loss_chunk`
    (`zoo.train_step`: "auto", None, or a divisor of the sequence); `clip` and `weight_decay`, which change no byte of a
    plan. A bad field is a ValueError naming it."""
    optimizer: str = "adamw"
    opt_dtype: str = "float32"
    grad_accum: int = 1
    opt_state: str = "device"
    params: str = "device"
    loss_chunk: int | str | None = "auto"
    clip: float = 1.0
    weight_decay: float = 0.1

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {', '.join(OPTIMIZER_NAMES)}")
        check_positive("grad_accum", self.grad_accum)
        if self.opt_state not in OPT_STATE_PLACES:
            raise ValueError(f"opt_state={self.opt_state!r}: choose one of {', '.join(OPT_STATE_PLACES)}")
        if self.params not in PARAMS_PLACES:
            raise ValueError(f"params={self.params!r}: choose one of {', '.join(PARAMS_PLACES)}")
        check_positive("clip", self.clip, float)
        if isinstance(self.weight_decay, bool) or not (isinstance(self.weight_decay, (int, float))
                                                       and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")


STEP = Training()   # the step of the planner and of a run without flags: AdamW, float32 moments, on the device
