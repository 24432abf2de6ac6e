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
    """What a training step keeps and how it updates: the optimizer and where its moments live, the float32 master
    copy, gradient accumulation, the loss's chunks, global-norm clipping and weight decay. The step
    (`zoo.train_step`) runs it; the planner (`zoo.plan`) counts its bytes. A bad field is a ValueError naming it.

    Args:
        optimizer: one of `zoo.optim.OPTIMIZER_NAMES` ("adamw": Loshchilov and Hutter, 2019, decoupled weight decay).
        opt_dtype: the dtype of the optimizer's moments ("float32", "bfloat16").
        grad_accum: the micro-batches per update (their gradients summed in float32; it divides the batch).
        opt_state: where the moments live between steps: "device" (HBM) or "host" (pinned host memory).
        params: "host" keeps a float32 master copy of 16-bit parameters in pinned host memory; "stream" also keeps
            the decoder stacks' 16-bit parameters there, each layer's brought into HBM as the scan reaches it and
            its gradient sent back (grad_accum 1); "device": none of them.
        loss_chunk: the positions per chunk of the loss's logits: "auto" (by their float32 bytes), None (the
            whole sequence at once) or a divisor of the sequence.
        clip: the global norm the gradients are clipped to (it changes no byte of a plan).
        weight_decay: the decoupled weight decay, >= 0 (it changes no byte of a plan).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> from zoo.training import Training
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), zoo.Recipe.none(), batch=2, seq=8,
        ...                   training=Training(opt_state="host"), peak=None)
        >>> p.state.optimizer_host, p.state.host == p.state.optimizer   # AdamW's moments in pinned host memory
        (True, True)
        >>> Training(optimizer="adagrad")
        Traceback (most recent call last):
        ValueError: optimizer='adagrad': choose one of adamw, adam, lion, momentum, sgd
    """
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
        if self.params == "stream" and self.grad_accum > 1:
            raise ValueError(f"params='stream' (--params stream) with grad_accum={self.grad_accum} (--grad-accum): "
                             f"streamed parameters send each "
                             f"layer's gradient to the host as the backward pass makes it, where micro-batches "
                             f"cannot add them up; use grad_accum=1 (a longer sequence or a larger batch per step), "
                             f"or params='host'")
        check_positive("clip", self.clip, float)
        if isinstance(self.weight_decay, bool) or not (isinstance(self.weight_decay, (int, float))
                                                       and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")


STEP = Training()   # the step of the planner and of a run without flags: AdamW, float32 moments, on the device
