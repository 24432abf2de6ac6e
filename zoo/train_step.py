"""The training step the main job runs and the planner compiles: one function, so the planner's peak is the job's.

`train_step(model, optimizer, batch)` is an ordinary function of NNX objects (loss, gradients, update, NaN guard) in
two halves (`step_gradients`, `step_update`); `jit_step` jits it over split state, as one program or, for parameters
streamed from the host, as two (`zoo.two_programs`); `abstract_step` builds it on shapes alone and `compile_abstract`
compiles it, nothing allocated. Why it lives in the library: docs/internals.md, "The training step".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import einops
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zoo import compile_options, renames, sharding, streamed_update
from zoo.checks import check_positive
from zoo.layers import moe
from zoo.loss import check_chunk, head_loss, next_token_loss, resolve_chunk
from zoo.opt_state import state_shardings
from zoo.optim import has_master, lr_schedule, make_optimizer
from zoo.training import STEP, Training
from zoo.two_programs import TwoPrograms

__all__ = ["FamilyStep", "Gradients", "abstract_batch", "abstract_step", "all_finite", "check_grad_accum",
           "check_loss_chunk", "compile_abstract", "eval_loss", "family_step", "jit_step", "loss_and_grads",
           "micro_batches", "moe_drops", "next_token_loss", "step_gradients", "step_update", "train_step"]

# The loss's chunk length by default: `zoo.loss.default_chunk` of the micro-batch's shape and the vocabulary.
DEFAULT_LOSS_CHUNK = "auto"
# The keywords the abstract step took before they were grouped in `Training` (docs/changes.md).
MOVED = {k: f"training=zoo.plan.Training({k}=...)" for k in ("optimizer", "opt_dtype", "grad_accum", "opt_state",
                                                             "params", "loss_chunk", "clip", "weight_decay")}


def moe_drops(aux: Any) -> tuple[jax.Array, jax.Array]:
    """The token copies capacity dispatch dropped and the token copies routed, summed over every MoE layer.

    Args:
        aux: the model's auxiliary outputs (the second value of `model.hidden`): {stack: its
            `zoo.layers.moe.MoEAux`, stacked over the stack's layers}.

    Returns:
        (dropped, routed), two int32 scalars; zeros for a model without experts.

    Examples:
        >>> from zoo.train_step import moe_drops
        >>> moe_drops({})
        (Array(0, dtype=int32), Array(0, dtype=int32))
    """
    return moe.drops(aux)


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite: one fused reduction under jit (leaves in pinned host
    memory, `--params stream`, read a slice at a time: `zoo.streamed_update.all_finite`).

    Args:
        tree: a pytree of arrays (a model's state, gradients, ...); its integer and boolean leaves are left out.

    Returns:
        a boolean scalar; True for a tree without floating-point leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.train_step import all_finite
        >>> all_finite({"w": jnp.ones(3), "step": jnp.int32(7)})
        Array(True, dtype=bool)
        >>> all_finite([jnp.array([1.0, jnp.nan])])
        Array(False, dtype=bool)
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if any(streamed_update.on_host(x) for x in leaves):
        return streamed_update.all_finite(leaves)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def check_grad_accum(batch: int, grad_accum: int) -> None:
    """Check that `grad_accum` micro-batches split the global batch evenly.

    Args:
        batch: the global batch B, in sequences.
        grad_accum: the number of micro-batches per update.

    Raises:
        ValueError: unless `grad_accum` is a positive integer dividing `batch`.

    Examples:
        >>> from zoo.train_step import check_grad_accum
        >>> check_grad_accum(8, 4)
        >>> check_grad_accum(8, 3)
        Traceback (most recent call last):
        ...
        ValueError: --grad-accum 3 must divide --batch 8 ...
    """
    check_positive("--grad-accum", grad_accum, optional=False)
    if batch % grad_accum:
        raise ValueError(f"--grad-accum {grad_accum} must divide --batch {batch} (the global batch is split into "
                         f"{grad_accum} micro-batches of batch / grad-accum sequences)")


def eval_loss(model: nnx.Module, batch: dict[str, jax.Array], loss_chunk=DEFAULT_LOSS_CHUNK) -> jax.Array:
    """The batch's weighted mean next-token loss: the model's forward pass alone (no extra heads), the head and the
    cross-entropy over chunks as in the training step (`loss_and_grads`).

    Args:
        model: a `zoo.models.CausalLM`.
        batch: {"tokens": [B, S+1] int32 (the inputs and, shifted by one, the targets), "weights": [B, S] float
            (each target's weight in the weighted mean)}.
        loss_chunk: the positions the head and the cross-entropy run at a time: "auto" (by the shapes,
            `zoo.loss.default_chunk`), None or 0 (the whole sequence), or a divisor of S.

    Returns:
        the loss, a float32 scalar.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.train_step import eval_loss
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> loss = nnx.jit(eval_loss)(model, batch)
        >>> loss.shape, bool(loss > 0)
        ((), True)
    """
    tokens, weights = batch["tokens"], batch["weights"]
    check_loss_chunk(tokens.shape[1] - 1, loss_chunk)
    h, _, _ = model.hidden(tokens[:, :-1], extra=False)
    head, head_weights = model.head_function()
    chunk = resolve_chunk(loss_chunk, h.shape[0], h.shape[1], model.config.vocab_size)
    return head_loss(head, head_weights, h, tokens[:, 1:], weights, chunk=chunk)


def check_loss_chunk(seq: int, loss_chunk) -> None:
    """Check a loss chunk length against the sequence.

    Args:
        seq: the sequence length S (the positions that have a target).
        loss_chunk: "auto", None or 0 (unchunked), or a chunk length, which must divide `seq`.

    Raises:
        ValueError: unless `loss_chunk` is "auto", None or 0 or a positive integer dividing `seq`.

    Examples:
        >>> from zoo.train_step import check_loss_chunk
        >>> check_loss_chunk(8, "auto"), check_loss_chunk(8, 4)
        (None, None)
        >>> check_loss_chunk(8, 3)
        Traceback (most recent call last):
        ...
        ValueError: --loss-chunk 3 does not divide the sequence length 8...
    """
    if isinstance(loss_chunk, str) and loss_chunk == "auto":
        return
    if isinstance(loss_chunk, int) and not isinstance(loss_chunk, bool) and loss_chunk == 0:
        return
    check_chunk(seq, loss_chunk, what="--loss-chunk")


def micro_batches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """[B, ...] -> [k, B/k, ...]: micro-batch i holds rows i, i+k, i+2k, ... A device's contiguous block of the
    data-parallel batch then splits into k rows of each micro-batch, so every micro-batch stays spread over all
    the data-parallel devices (a contiguous split would put each micro-batch on a few of them).

    Args:
        batch: {name: [B, ...]}, B a multiple of `k`.
        k: the number of micro-batches.

    Returns:
        {name: [k, B/k, ...]}.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.train_step import micro_batches
        >>> mb = micro_batches({"tokens": jnp.arange(6)[:, None]}, 2)
        >>> mb["tokens"].shape, mb["tokens"][0, :, 0].tolist()
        ((2, 3, 1), [0, 2, 4])
    """
    return {name: einops.rearrange(x, "(b k) ... -> k b ...", k=k) for name, x in batch.items()}


def loss_and_grads(model: nnx.Module, batch: dict[str, jax.Array], *, aux_loss: Callable, grad_accum: int = 1,
                   grad_dtype=None, loss_chunk=DEFAULT_LOSS_CHUNK):
    """(total loss, next-token loss, {extra head: its loss}, aux, gradients) of `batch`.

    The total is the next-token loss plus each extra head's loss times its `loss_weight` plus the auxiliary loss; the
    head and the cross-entropy run `loss_chunk` positions at a time ("auto": by the shapes, `zoo.loss.default_chunk`;
    None or 0: whole; else a divisor of the sequence). With `grad_accum` K > 1 the batch runs as K micro-batches
    (`micro_batches`) in a `jax.lax.scan`: float32 gradient sums, handed back in the parameters' dtypes (or
    `grad_dtype`), losses and aux adding up to the whole batch's (docs/internals.md, "Micro-batches").

    Args:
        model: a `zoo.models.CausalLM`.
        batch: {"tokens": [B, S+1] int32 (the inputs and, shifted by one, the targets), "weights": [B, S] float
            (each target's weight in the weighted mean)}.
        aux_loss: aux_loss(config, aux) -> the auxiliary loss added to the total (a family's
            `zoo.models.registry.Family.aux_loss`; `lambda cfg, aux: 0.0` for none).
        grad_accum: the micro-batches K, a divisor of B.
        grad_dtype: the gradients' dtype after a K > 1 sum (None: each parameter's own).
        loss_chunk: the positions the head and the cross-entropy run at a time: "auto" (by the shapes,
            `zoo.loss.default_chunk`), None or 0 (the whole sequence), or a divisor of S.

    Returns:
        (total loss, next-token loss, {extra head: its loss}, aux, gradients): float32 scalars, the model's aux, and
        the gradients as an `nnx.State` of the parameters.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.train_step import loss_and_grads
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> no_aux = lambda cfg, aux: 0.0
        >>> step = nnx.jit(lambda m, b: loss_and_grads(m, b, aux_loss=no_aux, grad_accum=2))
        >>> loss, lm_loss, extra, aux, grads = step(model, batch)
        >>> bool(loss == lm_loss), extra, type(grads).__name__
        (True, {}, 'State')
    """
    seq = batch["tokens"].shape[1] - 1
    check_grad_accum(batch["tokens"].shape[0], grad_accum)
    check_loss_chunk(seq, loss_chunk)

    def loss_fn(model, tokens, weights, batch_weights, aux_scale=1.0):
        h, aux, extra = model.hidden(tokens[:, :-1])
        targets = tokens[:, 1:]
        head, head_weights = model.head_function()
        chunk = resolve_chunk(loss_chunk, h.shape[0], h.shape[1], model.config.vocab_size)

        def cross_entropy(hidden, targets, weights, total_weight):
            return head_loss(head, head_weights, hidden, targets, weights, total_weight, chunk=chunk)

        lm_loss = cross_entropy(h, targets, weights, jnp.sum(batch_weights))
        loss = lm_loss + aux_scale * aux_loss(model.config, aux)
        extra_losses = {}
        for name, hidden in extra.items():
            module = getattr(model, name)
            extra_losses[name] = module.loss(hidden, targets, weights, batch_weights, cross_entropy)
            loss = loss + module.loss_weight * extra_losses[name]
        return loss, (lm_loss, extra_losses, aux)

    if grad_accum == 1:
        (loss, (lm_loss, extra_losses, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
            model, batch["tokens"], batch["weights"], batch["weights"])
        return loss, lm_loss, extra_losses, aux, grads
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # The body closes over the state's arrays and rebuilds its Variables under the scan's trace (NNX refuses
    # Variables of an outer trace).
    leaves, treedef = jax.tree.flatten((params, rest))

    def micro(acc, mb):
        m = nnx.merge(graphdef, *jax.tree.unflatten(treedef, leaves))
        (loss, (lm_loss, extra_losses, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
            m, mb["tokens"], mb["weights"], batch["weights"], 1.0 / grad_accum)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return acc, (loss, lm_loss, extra_losses, aux)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    acc, (losses, lm_losses, extras, auxes) = jax.lax.scan(micro, zeros, micro_batches(batch, grad_accum))
    grads = jax.tree.map(lambda a, p: a.astype(grad_dtype or p.dtype), acc, params)
    return (jnp.sum(losses), jnp.sum(lm_losses), jax.tree.map(jnp.sum, extras),
            jax.tree.map(lambda x: jnp.sum(x, axis=0), auxes), grads)


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array], *,
               aux_loss: Callable = lambda cfg, aux: 0.0,
               after_update: Callable = lambda model, aux: None,
               lr: optax.Schedule | None = None, grad_accum: int = 1,
               loss_chunk=DEFAULT_LOSS_CHUNK) -> dict[str, jax.Array]:
    """One optimizer step on `batch` ({"tokens": [B, S+1], "weights": [B, S]}), in place; returns its metrics ("loss",
    "total_loss", "aux_loss", each extra head's "<name>_loss", "grad_norm", the guard's "ok", "params_ok" and "kept",
    MoE "dropped" and "routed", "lr").

    `loss_chunk` and `grad_accum` are `loss_and_grads`' (ValueError where they do not divide). A step that is not finite
    changes nothing (`ok` False); `kept` False: the state left holds a non-finite parameter and must not be saved. `lr`
    (the schedule) decides the guard before the update; state in pinned host memory is updated streamed and needs it
    (docs/internals.md, "The NaN guard").

    Args:
        model: a `zoo.models.CausalLM`, updated in place.
        optimizer: its `nnx.Optimizer` (`zoo.optim.make_optimizer`), updated in place.
        batch: {"tokens": [B, S+1] int32 (the inputs and, shifted by one, the targets), "weights": [B, S] float
            (each target's weight in the weighted mean)}.
        aux_loss: aux_loss(config, aux) -> the auxiliary loss added to the total (none by default).
        after_update: after_update(model, aux), run after the optimizer's update (e.g. a router's bias update).
        lr: the learning-rate schedule, for the guard before the update and the "lr" metric (None: the guard checks
            the updated parameters instead); needed for state in pinned host memory.
        grad_accum: the micro-batches per update, a divisor of B.
        loss_chunk: the positions the head and the cross-entropy run at a time: "auto" (by the shapes,
            `zoo.loss.default_chunk`), None or 0 (the whole sequence), or a divisor of S.

    Returns:
        {metric name: scalar}, the metrics above.

    Raises:
        ValueError: a `grad_accum` or `loss_chunk` that does not divide, or host state without `lr`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.optim import lr_schedule, make_optimizer
        >>> from zoo.train_step import train_step
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> schedule = lr_schedule(lr=1e-3, steps=10, warmup=1)
        >>> optimizer = make_optimizer(model, schedule, clip=1.0, weight_decay=0.0, optimizer="sgd")
        >>> metrics = nnx.jit(lambda m, o, b: train_step(m, o, b, lr=schedule))(model, optimizer, batch)
        >>> bool(metrics["ok"]), int(optimizer.step[...])
        (True, 1)
    """
    return step_update(model, optimizer, step_gradients(model, optimizer, batch, aux_loss=aux_loss,
                                                        grad_accum=grad_accum, loss_chunk=loss_chunk),
                       after_update=after_update, lr=lr)


class Gradients(NamedTuple):
    """What `train_step`'s first half (`step_gradients`) hands its second (`step_update`): the total, next-token
    and extra heads' losses, the model's aux and the gradients (an `nnx.State` of the parameters).

    Examples:
        >>> from zoo.train_step import Gradients
        >>> Gradients._fields
        ('loss', 'lm_loss', 'extra_losses', 'aux', 'grads')
    """
    loss: jax.Array
    lm_loss: jax.Array
    extra_losses: dict
    aux: Any
    grads: Any


def step_gradients(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array], *,
                   aux_loss: Callable = lambda cfg, aux: 0.0, grad_accum: int = 1,
                   loss_chunk=DEFAULT_LOSS_CHUNK) -> Gradients:
    """`train_step`'s first half: the losses and gradients of `batch` (`loss_and_grads`; float32 sums of
    micro-batches where the optimizer keeps a float32 master). Changes nothing.

    Args:
        model: a `zoo.models.CausalLM`.
        optimizer: its `nnx.Optimizer` (whether it keeps a float32 master sets the gradients' dtype).
        batch: {"tokens": [B, S+1] int32, "weights": [B, S] float}.
        aux_loss: aux_loss(config, aux) -> the auxiliary loss added to the total.
        grad_accum: the micro-batches per update, a divisor of B.
        loss_chunk: the positions the head and the cross-entropy run at a time (`loss_and_grads`').

    Returns:
        the `Gradients`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.optim import lr_schedule, make_optimizer
        >>> from zoo.train_step import step_gradients
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> optimizer = make_optimizer(model, lr_schedule(lr=1e-3, steps=10, warmup=1), clip=1.0, weight_decay=0.0)
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> nnx.eval_shape(step_gradients, model, optimizer, batch).loss
        ShapeDtypeStruct(shape=(), dtype=float32)
    """
    # An optimizer with a float32 master copy takes --grad-accum's float32 sums as they are.
    return Gradients(*loss_and_grads(model, batch, aux_loss=aux_loss, grad_accum=grad_accum, loss_chunk=loss_chunk,
                                     grad_dtype=jnp.float32 if has_master(optimizer) else None))


def step_update(model: nnx.Module, optimizer: nnx.Optimizer, g: Gradients, *,
                after_update: Callable = lambda model, aux: None,
                lr: optax.Schedule | None = None) -> dict[str, jax.Array]:
    """`train_step`'s second half: the update from `g` (`step_gradients`'), in place, behind the NaN guard; returns
    the step's metrics (`train_step`'s).

    Args:
        model: the model `g` was made for, updated in place.
        optimizer: its `nnx.Optimizer`, updated in place.
        g: the losses, aux and gradients of the batch.
        after_update: after_update(model, aux), run after the optimizer's update.
        lr: the learning-rate schedule (`train_step`'s).

    Returns:
        {metric name: scalar}, `train_step`'s metrics.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.optim import lr_schedule, make_optimizer
        >>> from zoo.train_step import step_gradients, step_update
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> schedule = lr_schedule(lr=1e-3, steps=10, warmup=1)
        >>> optimizer = make_optimizer(model, schedule, clip=1.0, weight_decay=0.0)
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> step = lambda m, o, b: step_update(m, o, step_gradients(m, o, b), lr=schedule)
        >>> nnx.eval_shape(step, model, optimizer, batch)["ok"]
        ShapeDtypeStruct(shape=(), dtype=bool)
    """
    loss, lm_loss, extra_losses, aux, grads = g
    grad_norm = streamed_update.global_norm(grads)   # optax.global_norm, host-resident gradients a slice at a time
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    rate = None
    if lr is not None:
        rate = jnp.asarray(lr(optimizer.step[...]), jnp.float32)   # the rate this update uses
        ok = ok & jnp.isfinite(rate)
    dropped, routed = moe_drops(aux)

    streamed = streamed_update.hosted(optimizer)
    if streamed and lr is None:
        raise ValueError("optimizer state in host memory (--opt-state host, --params host) is updated a slice at a "
                         "time, with the NaN guard decided before the update: train_step needs the learning-rate "
                         "schedule (lr=...)")
    # What the guard's select below keeps: everything, but the parameters and their state a streamed update guards
    # per slice itself (selecting them here would need the old and new state whole).
    kept_here = (streamed_update.unguarded(model, optimizer),) if streamed else ()
    # nnx.state holds the live Variables; mapping over it snapshots their current values.
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer), *kept_here))
    if streamed:
        streamed_update.update(model, optimizer, grads, ok=ok)
    else:
        optimizer.update(model, grads)
    after_update(model, aux)
    if lr is None:
        ok = ok & all_finite(nnx.state(model))   # the updated parameters: e.g. a non-finite rate, finite gradients
    # The NaN guard: keep the old state where the step is not finite (a select, no host round trip).
    nnx.update((model, optimizer), jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                                nnx.state((model, optimizer), *kept_here), before))
    # The state kept, checked: with `lr`, the tripwire of an update that passed the guard and still made a parameter
    # non-finite; with or without it, a parameter that was non-finite before the step (the select kept it).
    params_ok = all_finite(nnx.state(model))
    kept = params_ok
    ok = ok & params_ok
    weighted = sum((getattr(model, n).loss_weight * v for n, v in extra_losses.items()), jnp.zeros((), jnp.float32))
    metrics = {"loss": lm_loss, "total_loss": loss, "aux_loss": loss - lm_loss - weighted, "grad_norm": grad_norm,
               "ok": ok, "params_ok": params_ok, "kept": kept, "dropped": dropped, "routed": routed}
    for name, value in extra_losses.items():
        metrics[f"{name}_loss"] = value   # before its weight
    if rate is not None:
        metrics["lr"] = rate
    return metrics


def family_step(family, lr: optax.Schedule | None = None, grad_accum: int = 1,
                loss_chunk=DEFAULT_LOSS_CHUNK) -> Callable:
    """`train_step` with the model family's auxiliary loss and post-update hook (zoo.models.registry.Family), the
    learning-rate schedule `lr` for the cheap guard, `grad_accum` micro-batches per update and the loss's
    `loss_chunk`.

    Args:
        family: the model's `zoo.models.registry.Family` (`zoo.models.registry.family(name)`).
        lr: the learning-rate schedule (`train_step`'s `lr`).
        grad_accum: the micro-batches per update.
        loss_chunk: the positions the head and the cross-entropy run at a time: "auto" (by the shapes,
            `zoo.loss.default_chunk`), None or 0 (the whole sequence), or a divisor of S.

    Returns:
        a `FamilyStep`: step(model, optimizer, batch) -> metrics, for `jit_step`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.models.registry import family
        >>> from zoo.optim import lr_schedule, make_optimizer
        >>> from zoo.train_step import family_step
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> optimizer = make_optimizer(model, lr_schedule(lr=1e-3, steps=10, warmup=1), clip=1.0, weight_decay=0.0)
        >>> step = family_step(family("llama3"), grad_accum=2)
        >>> nnx.eval_shape(step, model, optimizer, batch)["loss"]
        ShapeDtypeStruct(shape=(), dtype=float32)
    """
    return FamilyStep(family, lr, grad_accum, loss_chunk)


@dataclasses.dataclass(frozen=True)
class FamilyStep:
    """`train_step` with a family's auxiliary loss and post-update hook (`family_step`'s): called as
    step(model, optimizer, batch) -> metrics, and in its two halves, `gradients` then `update`, for a step run as two
    programs (`jit_step(..., two_programs=True)`).

    Args:
        family: the model's `zoo.models.registry.Family`.
        lr: the learning-rate schedule (`train_step`'s `lr`).
        grad_accum: the micro-batches per update.
        loss_chunk: the positions the head and the cross-entropy run at a time.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.optim import lr_schedule, make_optimizer
        >>> from zoo.models.registry import family
        >>> from zoo.train_step import family_step
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> schedule = lr_schedule(lr=1e-3, steps=10, warmup=1)
        >>> optimizer = make_optimizer(model, schedule, clip=1.0, weight_decay=0.0)
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> step = family_step(family("llama3"), schedule)
        >>> halves = lambda m, o, b: step.update(m, o, step.gradients(m, o, b))
        >>> nnx.eval_shape(halves, model, optimizer, batch)["loss"]
        ShapeDtypeStruct(shape=(), dtype=float32)
    """
    family: Any
    lr: optax.Schedule | None = None
    grad_accum: int = 1
    loss_chunk: Any = DEFAULT_LOSS_CHUNK

    def gradients(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> Gradients:
        """`step_gradients` with the family's auxiliary loss."""
        return step_gradients(model, optimizer, batch, aux_loss=self.family.aux_loss, grad_accum=self.grad_accum,
                              loss_chunk=self.loss_chunk)

    def update(self, model: nnx.Module, optimizer: nnx.Optimizer, g: Gradients) -> dict[str, jax.Array]:
        """`step_update` with the family's post-update hook."""
        return step_update(model, optimizer, g, after_update=self.family.after_update, lr=self.lr)

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]):
        """The whole step, `train_step`: both halves in one trace.

        Args:
            model: a `zoo.models.CausalLM`, updated in place.
            optimizer: its `nnx.Optimizer`, updated in place.
            batch: {"tokens": [B, S+1] int32, "weights": [B, S] float}.

        Returns:
            {metric name: scalar}, `train_step`'s metrics.
        """
        return self.update(model, optimizer, self.gradients(model, optimizer, batch))


# -- under jit ----------------------------------------------------------------------------------------------------
def jit_step(model: nnx.Module, optimizer: nnx.Optimizer, step_fn: Callable, *, keep_shardings: bool = False,
             two_programs: bool = False):
    """(jitted step over (state, batch) -> (state, metrics), graphdef, state); the state is donated. With
    `keep_shardings`, the new state is laid out as the old one (the state's leaves must carry shardings). State in
    host memory between steps enters and leaves the step as host arrays; a `step_fn` other than `train_step` must
    handle them itself. With `two_programs`, the gradients and the update are two jitted programs run one after
    the other (`zoo.two_programs.TwoPrograms`, as `--params stream` runs).

    Args:
        model: the model, split (with `optimizer`) into the graphdef and the state.
        optimizer: its `nnx.Optimizer`.
        step_fn: step_fn(model, optimizer, batch) -> metrics, updating both in place (`family_step`'s); with
            `two_programs`, a `FamilyStep` (its `gradients` and `update` halves).
        keep_shardings: lay the new state out as the old one.
        two_programs: run the step as two programs.

    Returns:
        (step, graphdef, state): step(state, batch) -> (new state, metrics), jitted with `state` donated;
        `nnx.merge(graphdef, state)` gives the model and the optimizer back.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> from zoo.models.registry import family
        >>> from zoo.optim import lr_schedule, make_optimizer
        >>> from zoo.train_step import family_step, jit_step
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> batch = {"tokens": jnp.zeros((2, 9), jnp.int32), "weights": jnp.ones((2, 8))}
        >>> schedule = lr_schedule(lr=1e-3, steps=10, warmup=1)
        >>> optimizer = make_optimizer(model, schedule, clip=1.0, weight_decay=0.0, optimizer="sgd")
        >>> step, graphdef, state = jit_step(model, optimizer, family_step(family("llama3"), schedule))
        >>> state, metrics = step(state, batch)
        >>> model, optimizer = nnx.merge(graphdef, state)
        >>> bool(metrics["ok"]), int(optimizer.step[...])
        (True, 1)
    """
    graphdef, state = nnx.split((model, optimizer))
    shardings = jax.tree.map(lambda x: x.sharding, state) if keep_shardings else None

    def over_state(fn):   # fn(model, optimizer, x) as a function of the split state: (state, x) -> (state, out)
        def run(state, x):
            model, optimizer = nnx.merge(graphdef, state)
            out = fn(model, optimizer, x)
            return nnx.state((model, optimizer)), out
        return run

    kwargs = {"out_shardings": (shardings, None)} if keep_shardings else {}
    if not two_programs:
        return jax.jit(over_state(step_fn), donate_argnums=0, **kwargs), graphdef, state
    if not isinstance(step_fn, FamilyStep):
        raise ValueError(f"jit_step(two_programs=True) runs a step's gradients and update as two programs: step_fn "
                         f"must be a zoo.train_step.FamilyStep (family_step's), got {type(step_fn).__name__}")
    gradients = over_state(step_fn.gradients)   # changes nothing: only its output leaves the first program
    return (TwoPrograms(jax.jit(lambda state, batch: gradients(state, batch)[1]),
                        jax.jit(over_state(step_fn.update), donate_argnums=0, **kwargs)), graphdef, state)


def abstract_batch(batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a training batch: tokens [B, S+1] int32 (inputs and shifted targets), weights [B, S] f32.

    Args:
        batch: the batch B, in sequences.
        seq: the sequence length S.

    Returns:
        {"tokens": ShapeDtypeStruct, "weights": ShapeDtypeStruct}.

    Examples:
        >>> from zoo.train_step import abstract_batch
        >>> abstract_batch(2, 8)["tokens"]
        ShapeDtypeStruct(shape=(2, 9), dtype=int32)
    """
    return {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
            "weights": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}


@renames.keywords(**MOVED)
def abstract_step(family, cfg, recipe, *, training: Training = STEP, schedule: optax.Schedule | None = None,
                  mesh=None):
    """(jitted step, graphdef, abstract state) for `cfg` under `recipe`, the step `training` describes
    (`zoo.training.Training`): the model and optimizer built from shapes alone (no memory). `schedule` only changes
    constants of the program, never its memory. With `mesh`, every variable carries its sharding by the rules
    (`zoo.sharding.shardings`) and the step keeps them; state in pinned host memory without a mesh is laid out on
    the first device.

    Args:
        family: the model's `zoo.models.registry.Family`.
        cfg: the model's config (an `LMConfig` of the family).
        recipe: the placement of each tag (a `zoo.Recipe`).
        training: the step: optimizer, state placement, micro-batches, loss chunks (`zoo.training.Training`).
        schedule: the learning-rate schedule (None: a stand-in).
        mesh: the device mesh the state is sharded over (None: no sharding).

    Returns:
        (step, graphdef, state) as `jit_step`'s, `state` of ShapeDtypeStructs.

    Examples:
        >>> import jax
        >>> import zoo
        >>> from zoo.models.registry import family
        >>> from zoo.train_step import abstract_batch, abstract_step
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> step, graphdef, state = abstract_step(family("llama3"), cfg, zoo.Recipe.none())
        >>> _, metrics = jax.eval_shape(step, state, abstract_batch(2, 8))
        >>> metrics["loss"]
        ShapeDtypeStruct(shape=(), dtype=float32)
    """
    schedule = schedule if schedule is not None else lr_schedule(lr=1e-4, steps=100, warmup=10)

    def build():
        model = family.build(cfg, recipe=recipe, rngs=nnx.Rngs(0))
        return model, make_optimizer(model, schedule, clip=training.clip, weight_decay=training.weight_decay,
                                     optimizer=training.optimizer, opt_dtype=training.opt_dtype,
                                     master=training.params != "device")

    step_fn = family_step(family, schedule, training.grad_accum, training.loss_chunk)
    if mesh is None and training.opt_state == "device" and training.params == "device":
        model, opt = nnx.eval_shape(build)
        return jit_step(model, opt, step_fn)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):  # logical names are not mesh axes
        model, opt = nnx.eval_shape(build)
    graphdef, state = nnx.split((model, opt))
    # Without a mesh, a one-device mesh of the first device: an abstract argument's memory kind reaches the traced
    # value only through a NamedSharding (a SingleDeviceSharding's pinned_host would have jit bring it into HBM whole
    # on entry, where the streamed update cannot see it: zoo.streamed_update).
    placed = sharding.shardings(state, mesh if mesh is not None else sharding.make_mesh(None, jax.devices()[:1]))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                         state_shardings(state, placed, opt_state=training.opt_state, params=training.params))
    model, opt = nnx.merge(graphdef, state)
    # Streamed parameters: the gradients and the update as two programs (XLA's GPU compiler crashes on them as one)
    return jit_step(model, opt, step_fn, keep_shardings=True, two_programs=training.params == "stream")


@renames.keywords(**MOVED)
def compile_abstract(family, cfg, recipe, *, batch: int, seq: int, training: Training = STEP,
                     schedule: optax.Schedule | None = None, mesh=None):
    """(compiled step, graphdef, abstract state): `abstract_step` lowered on abstract inputs and compiled for the device
    present with the XLA options of its recipe (`zoo.compile_options.for_step`); with a concrete `mesh`, as the main job
    runs it (the state on the rules' shardings, the batch over the data axes). Nothing is allocated.
    `training.grad_accum` must divide `batch` and `training.loss_chunk` `seq` (ValueError before tracing).

    Args:
        family: the model's `zoo.models.registry.Family`.
        cfg: the model's config (an `LMConfig` of the family).
        recipe: the placement of each tag (a `zoo.Recipe`).
        batch: the global batch B, in sequences.
        seq: the sequence length S.
        training: the step: optimizer, state placement, micro-batches, loss chunks (`zoo.training.Training`).
        schedule: the learning-rate schedule (None: a stand-in).
        mesh: the device mesh the step runs on (None: the first device).

    Returns:
        (compiled step, graphdef, abstract state); the compiled step's `memory_analysis()` gives its bytes.

    Examples:
        >>> import zoo
        >>> from zoo.models.registry import family
        >>> from zoo.train_step import compile_abstract
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> compiled, graphdef, state = compile_abstract(family("llama3"), cfg, zoo.Recipe.none(), batch=2, seq=8,
        ...                                              training=zoo.plan.Training(optimizer="sgd"))
        >>> compiled.memory_analysis().temp_size_in_bytes > 0
        True
    """
    check_grad_accum(batch, training.grad_accum)
    check_loss_chunk(seq, training.loss_chunk)
    jitted, graphdef, state = abstract_step(family, cfg, recipe, training=training, schedule=schedule, mesh=mesh)
    platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
    options = compile_options.for_step(recipe, platform).options
    if mesh is None:
        return jitted.lower(state, abstract_batch(batch, seq)).compile(compiler_options=options), graphdef, state
    shapes = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, ndim=len(x.shape)))
              for k, x in abstract_batch(batch, seq).items()}
    with sharding.use(mesh):
        return jitted.lower(state, shapes).compile(compiler_options=options), graphdef, state
