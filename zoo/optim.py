"""The optimizer the training step runs: the learning-rate schedule, the gradient transformation (global-norm
clipping, then one of `OPTIMIZER_NAMES`, with its moments in a chosen dtype), optionally over a float32 master
copy of 16-bit parameters (`with_master`), and the `nnx.Optimizer` over a model's parameters. The transform is also
given in parts (`TxParts`: the clip, then a transform elementwise given its shared step counts), which the streamed
update of state in host memory runs a slice at a time (`zoo.streamed_update`). The planner counts these optimizers'
moments (zoo.plan.types.OPTIMIZERS) and the master (4 bytes a parameter)."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# Optimizers the step can run (the planner counts their moments: zoo.plan.types.OPTIMIZERS).
OPTIMIZER_NAMES = ("adamw", "adam", "lion", "momentum", "sgd")


def lr_schedule(*, lr: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to lr/10 at `steps`; lr/10 after it.
    With `warmup >= steps` the warm-up runs its whole course and the rate is lr/10 from the step after it."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
                                              end_value=lr / 10)


def state_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` with its floating-point state (the moments) held in `dtype` whatever the parameters' dtype: bf16
    parameters with float32 moments, or float32 parameters with bf16 moments (a published 671B run's choice). The
    update is computed in the promoted dtype and its new state cast back, so the state's dtype never changes between
    steps."""
    dtype = jnp.dtype(dtype)

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(updates, state, params=None):
        updates, new = tx.update(updates, state, params)
        return updates, jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)

    return optax.GradientTransformation(lambda params: cast(tx.init(params)), update)


class MasterState(NamedTuple):
    """`with_master`'s state: the float32 master copy of the parameters (`master`, a tree like the parameters) and
    the wrapped transform's state, initialised on the master (`inner`). In an `nnx.Optimizer` whose transform is
    `with_master(...)` the master is `optimizer.opt_state.master`: the path ("opt_state", MASTER) of the optimizer's
    state, where `zoo.opt_state` finds it to place it."""
    master: Any
    inner: Any


MASTER = MasterState._fields[0]   # the master's key in the optimizer's state: "master"


def with_master(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run on a float32 master copy of the parameters (mixed-precision "master weights"): the state holds the
    master and `tx`'s state, initialised on it; an update upcasts the gradients to float32, runs `tx` against the master
    and adds its update to it, so an update too small to move a bf16 parameter still moves the master. The updates it
    returns are float32 `new master - params`; `MasterOptimizer` (`make_optimizer(master=True)`) sets the parameters to
    `new master.astype(dtype)` exactly instead."""
    def init(params):
        master = jax.tree.map(_to_f32, params)
        return MasterState(master, tx.init(master))

    def update(updates, state, params=None):
        grads = jax.tree.map(_to_f32, updates)
        step, inner = tx.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, step)   # float32 + float32: the master keeps its dtype
        if params is not None:
            step = jax.tree.map(lambda m, p: m - p.astype(m.dtype), master, params)
        return step, MasterState(master, inner)

    return optax.GradientTransformation(init, update)


def _to_f32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


class MasterOptimizer(nnx.Optimizer):
    """An `nnx.Optimizer` over `with_master(tx)`: after each update the parameters are the new master rounded to
    their dtype, exactly (`nnx.Optimizer` would add `with_master`'s update to the 16-bit parameters: rounded
    twice). Under jit the addition it makes first is dead code, removed."""

    def update(self, model, grads, /, **kwargs):
        updates = super().update(model, grads, **kwargs)
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        master = nnx.as_pure(self.opt_state.master)
        nnx.update(model, jax.tree.map(lambda m, p: m.astype(p.dtype), master, params))
        return updates


def has_master(optimizer) -> bool:
    """Whether `optimizer` keeps a float32 master copy of the parameters (`make_optimizer(master=True)`)."""
    return isinstance(optimizer, MasterOptimizer)


class TxParts(NamedTuple):
    """`make_tx`'s transform in the pieces a streamed update (`zoo.streamed_update`) runs one slice at a time: the
    clip of the gradients' global norm to `clip` (the one step that reads every parameter), then `elementwise`, a
    transform that is elementwise given the scalars its state shares between parameters (the step counts), on a
    float32 master copy with `master`. `transform()` is `make_tx`'s whole transform; `states(opt_state)` finds the
    master (None without one) and `elementwise`'s state in its state (the structure `transform` makes)."""
    clip: float
    elementwise: optax.GradientTransformation
    master: bool

    def transform(self) -> optax.GradientTransformation:
        tx = optax.chain(optax.clip_by_global_norm(self.clip), self.elementwise)
        return with_master(tx) if self.master else tx

    def states(self, opt_state) -> tuple[Any, Any]:
        if self.master:
            return opt_state.master, opt_state.inner[1]
        return None, opt_state[1]


def tx_parts(schedule: optax.Schedule, *, optimizer: str = "adamw", clip: float = 1.0, weight_decay: float = 0.1,
             opt_dtype: str | None = None, master: bool = False) -> TxParts:
    """`make_tx`'s transform in parts (`TxParts`); the arguments are `make_tx`'s."""
    if optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZER_NAMES)}")
    inner = {"adamw": lambda: optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay),
             "adam": lambda: optax.adam(schedule, b1=0.9, b2=0.95),
             "lion": lambda: optax.lion(schedule, weight_decay=weight_decay),
             "momentum": lambda: optax.sgd(schedule, momentum=0.9),
             "sgd": lambda: optax.sgd(schedule)}[optimizer]()
    if opt_dtype is not None:
        inner = state_in(inner, opt_dtype)
    return TxParts(clip, inner, master)


def make_tx(schedule: optax.Schedule, *, optimizer: str = "adamw", clip: float = 1.0, weight_decay: float = 0.1,
            opt_dtype: str | None = None, master: bool = False) -> optax.GradientTransformation:
    """Clip the gradients' global norm to `clip`, then `optimizer` on `schedule` (AdamW: b1 0.9, b2 0.95, as the
    published dense and MoE runs trained); moments in `opt_dtype` (None: the parameters' dtype, float32 with a
    master). With `master`, the whole of it (the clip included: on the float32 gradients) runs on a float32 master
    copy of the parameters (`with_master`, the outermost transform: its state is the optimizer's state's root)."""
    return tx_parts(schedule, optimizer=optimizer, clip=clip, weight_decay=weight_decay, opt_dtype=opt_dtype,
                    master=master).transform()


def make_optimizer(model: nnx.Module, schedule: optax.Schedule, *, clip: float, weight_decay: float,
                   optimizer: str = "adamw", opt_dtype: str | None = None, master: bool = False) -> nnx.Optimizer:
    """`make_tx`'s optimizer over the model's parameters; with `master`, a `MasterOptimizer` (float32 master copy,
    the parameters its rounding). It carries its transform's parts (`parts_of`), which a streamed update needs."""
    kw = dict(optimizer=optimizer, clip=clip, weight_decay=weight_decay, opt_dtype=opt_dtype, master=master)
    opt = (MasterOptimizer if master else nnx.Optimizer)(model, make_tx(schedule, **kw), wrt=nnx.Param)
    opt.tx_parts = tx_parts(schedule, **kw)
    return opt


def parts_of(optimizer: nnx.Optimizer) -> TxParts | None:
    """The parts of `optimizer`'s transform (`TxParts`) if `make_optimizer` made it, else None."""
    return getattr(optimizer, "tx_parts", None)
