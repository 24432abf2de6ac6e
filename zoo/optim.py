"""The optimizer the training step runs: the learning-rate schedule, the gradient transformation (global-norm
clipping, then one of `OPTIMIZER_NAMES`, with its moments in a chosen dtype), and the `nnx.Optimizer` over a
model's parameters. The planner counts these optimizers' moments (zoo.plan.types.OPTIMIZERS)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# Optimizers the step can run (the planner counts their moments: zoo.plan.types.OPTIMIZERS).
OPTIMIZER_NAMES = ("adamw", "adam", "lion", "momentum", "sgd")


def lr_schedule(*, lr: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to lr/10 at `steps`; lr/10 after it."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
                                              end_value=lr / 10)


def state_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` with its floating-point state (the moments) held in `dtype` whatever the parameters' dtype: bf16
    parameters with float32 moments, or float32 parameters with bf16 moments (DeepSeek-V3's choice). The update is
    computed in the promoted dtype and its new state cast back, so the state's dtype never changes between steps."""
    dtype = jnp.dtype(dtype)

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(updates, state, params=None):
        updates, new = tx.update(updates, state, params)
        return updates, jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)

    return optax.GradientTransformation(lambda params: cast(tx.init(params)), update)


def make_tx(schedule: optax.Schedule, *, optimizer: str = "adamw", clip: float = 1.0, weight_decay: float = 0.1,
            opt_dtype: str | None = None) -> optax.GradientTransformation:
    """Clip the gradients' global norm to `clip`, then `optimizer` on `schedule` (AdamW: b1 0.9, b2 0.95, as Llama 3
    and DeepSeek-V3 trained); moments in `opt_dtype` (None: the parameters' dtype)."""
    if optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZER_NAMES)}")
    inner = {"adamw": lambda: optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay),
             "adam": lambda: optax.adam(schedule, b1=0.9, b2=0.95),
             "lion": lambda: optax.lion(schedule, weight_decay=weight_decay),
             "momentum": lambda: optax.sgd(schedule, momentum=0.9),
             "sgd": lambda: optax.sgd(schedule)}[optimizer]()
    if opt_dtype is not None:
        inner = state_in(inner, opt_dtype)
    return optax.chain(optax.clip_by_global_norm(clip), inner)


def make_optimizer(model: nnx.Module, schedule: optax.Schedule, *, clip: float, weight_decay: float,
                   optimizer: str = "adamw", opt_dtype: str | None = None) -> nnx.Optimizer:
    """`make_tx`'s optimizer over the model's parameters."""
    tx = make_tx(schedule, optimizer=optimizer, clip=clip, weight_decay=weight_decay, opt_dtype=opt_dtype)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
