"""The training step the main job runs and the planner compiles: one function, so the planner's peak is the job's.

`train_step(model, optimizer, batch)` is an ordinary function of NNX objects: next-token loss (plus the model's
auxiliary loss), gradients, the optimizer update, the model's non-gradient updates (e.g. DeepSeek-V3's routing
bias), and the NaN guard: a step whose loss, gradient norm or updated parameters are not finite leaves every
state as it was. `jit_step` puts the whole step under one `jax.jit` (split into graph and state, merge inside,
donate the state). `abstract_step` builds the same jitted step on shapes alone (`nnx.eval_shape`: no memory), and
`compile_abstract` compiles it for the device present: `compiled.memory_analysis()` is XLA's own account of
arguments, outputs, donated (aliased) bytes and temporaries, before anything is allocated.

Why this lives in `zoo` (not in `recipes/loop.py`): the planner (`zoo.plan`, peak="compile") must compile exactly
the step the main job runs, and `zoo` never imports `recipes`. Passing a step function into `zoo.plan` instead
would let the two drift apart silently; one definition cannot.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zoo import compile_options
from zoo.layers import moe

# Optimizers the step can run (the planner counts their moments: zoo.plan.types.OPTIMIZERS).
OPTIMIZER_NAMES = ("adamw", "adam", "lion", "momentum", "sgd")


def next_token_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted mean cross-entropy, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def moe_drops(aux: Any) -> tuple[jax.Array, jax.Array]:
    """(token copies dropped by capacity dispatch, token copies routed), summed over every MoE layer in the
    model's aux ({stack: MoEAux stacked over layers}); zeros for a model without experts."""
    return moe.drops(aux)


def all_finite(tree) -> jax.Array:
    """True iff every floating-point leaf of `tree` is finite: one fused reduction under jit."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array], *,
               aux_loss: Callable = lambda cfg, aux: 0.0,
               after_update: Callable = lambda model, aux: None,
               lr: optax.Schedule | None = None) -> dict[str, jax.Array]:
    """One optimizer step on `batch` ({"tokens": [B, S+1], "weights": [B, S]}), in place. Returns metrics.

    If the loss, the gradient norm or any updated parameter is not finite, nothing changes (`metrics["ok"]` is
    False; `metrics["params_ok"]` says whether the parameters were the cause).

    `lr`, the optimizer's learning-rate schedule, makes the guard cheap. Without it, whether the updated
    parameters are finite is known only once all of them are computed, so XLA keeps the old state beside the new
    one and selects between them in a second pass over both (for float32 AdamW, 36 bytes read and 12 written per
    parameter, and a second copy of the state in HBM). With it the decision is taken before the update: with a
    finite loss and gradient norm, a finite previous state and a finite rate, the updates of the optimizers this
    step runs (`make_tx`: clipped AdamW, Adam, Lion, momentum, SGD) are finite, so `ok` is known first and the
    select fuses into the update, in place. The updated parameters are still checked afterwards: should they
    be non-finite all the same (an overflow), `metrics["kept"]` is False and the caller must not save this state.
    """
    tokens = batch["tokens"]

    def loss_fn(model):
        logits, aux = model(tokens[:, :-1], return_aux=True)
        lm_loss = next_token_loss(logits, tokens[:, 1:], batch["weights"])
        return lm_loss + aux_loss(model.config, aux), (lm_loss, aux)

    (loss, (lm_loss, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    rate = None
    if lr is not None:
        rate = jnp.asarray(lr(optimizer.step[...]), jnp.float32)   # the rate this update uses
        ok = ok & jnp.isfinite(rate)
    dropped, routed = moe_drops(aux)

    # nnx.state holds the live Variables; mapping over it snapshots their current values.
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
    optimizer.update(model, grads)
    after_update(model, aux)
    if lr is None:
        params_ok = all_finite(nnx.state(model))   # e.g. a non-finite learning rate with finite gradients
        ok = ok & params_ok
    # The NaN guard: keep the old state where the step is not finite (a select, no host round trip).
    nnx.update((model, optimizer), jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                                nnx.state((model, optimizer)), before))
    kept = jnp.bool_(True)
    if lr is not None:
        # The tripwire: an update that passed the guard and still made a parameter non-finite was applied.
        params_ok = all_finite(nnx.state(model))   # the same check as without `lr`, after the select
        kept = params_ok
        ok = ok & params_ok
    metrics = {"loss": lm_loss, "total_loss": loss, "grad_norm": grad_norm, "ok": ok, "params_ok": params_ok,
               "kept": kept, "dropped": dropped, "routed": routed}
    if rate is not None:
        metrics["lr"] = rate
    return metrics


def family_step(family, lr: optax.Schedule | None = None) -> Callable:
    """`train_step` with the model family's auxiliary loss and post-update hook (zoo.models.registry.Family), and
    the learning-rate schedule `lr` for the cheap guard."""
    return lambda m, o, b: train_step(m, o, b, aux_loss=family.aux_loss, after_update=family.after_update, lr=lr)


# -- the optimizer ------------------------------------------------------------------------------------------------
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


# -- under jit ----------------------------------------------------------------------------------------------------
def jit_step(model: nnx.Module, optimizer: nnx.Optimizer, step_fn: Callable, *, keep_shardings: bool = False):
    """(jitted step over (state, batch) -> (state, metrics), graphdef, state). The state is donated. With
    `keep_shardings`, the new state is laid out as the old one (a sharded run's state stays on its shardings; the
    state's leaves must then carry shardings: arrays, or ShapeDtypeStructs with `sharding=`)."""
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = step_fn(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    kwargs = {"out_shardings": (jax.tree.map(lambda x: x.sharding, state), None)} if keep_shardings else {}
    return jax.jit(step, donate_argnums=0, **kwargs), graphdef, state


def abstract_batch(batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a training batch: tokens [B, S+1] int32 (inputs and shifted targets), weights [B, S] f32."""
    return {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
            "weights": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}


def abstract_step(family, cfg, recipe, *, schedule: optax.Schedule | None = None, optimizer: str = "adamw",
                  clip: float = 1.0, weight_decay: float = 0.1, opt_dtype: str | None = None, seed: int = 0,
                  mesh=None):
    """(jitted step, graphdef, abstract state) for `cfg` under `recipe`: the model and optimizer built from shapes
    alone (no memory). `schedule` only changes constants of the program, never its memory. With `mesh`, every
    variable carries its sharding by the rules (`zoo.sharding.shardings`) and the step keeps them."""
    schedule = schedule if schedule is not None else lr_schedule(lr=1e-4, steps=100, warmup=10)

    def build():
        model = family.build(cfg, recipe=recipe, rngs=nnx.Rngs(seed))
        return model, make_optimizer(model, schedule, clip=clip, weight_decay=weight_decay, optimizer=optimizer,
                                     opt_dtype=opt_dtype)

    if mesh is None:
        model, opt = nnx.eval_shape(build)
        return jit_step(model, opt, family_step(family, schedule))
    from zoo import sharding

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):  # logical names are not mesh axes
        model, opt = nnx.eval_shape(build)
    graphdef, state = nnx.split((model, opt))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                         sharding.shardings(state, mesh))
    model, opt = nnx.merge(graphdef, state)
    return jit_step(model, opt, family_step(family, schedule), keep_shardings=True)


def compile_abstract(family, cfg, recipe, *, batch: int, seq: int, mesh=None, **kwargs):
    """(compiled step, graphdef, abstract state): `abstract_step` lowered on abstract inputs and compiled for the
    device present, with the XLA options that hide a recipe's host copies (`zoo.compile_options.for_step`: only
    where the recipe offloads; the user's `XLA_FLAGS` win). Nothing is allocated; `compiled.memory_analysis()` says
    what running it would take (per device under a mesh). With a (concrete) `mesh`, as the main job runs it: the
    state on the rules' shardings, the batch split over the data axes, traced inside `zoo.sharding.use(mesh)`
    (jit's cache does not key on the rules: the activation constraints are read at this trace). The main job and
    the planner both compile through here."""
    jitted, graphdef, state = abstract_step(family, cfg, recipe, mesh=mesh, **kwargs)
    platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
    options = compile_options.for_step(recipe, platform).options
    if mesh is None:
        return jitted.lower(state, abstract_batch(batch, seq)).compile(compiler_options=options), graphdef, state
    from zoo import sharding

    shapes = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, ndim=len(x.shape)))
              for k, x in abstract_batch(batch, seq).items()}
    with sharding.use(mesh):
        return jitted.lower(state, shapes).compile(compiler_options=options), graphdef, state
