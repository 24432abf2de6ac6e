"""DeepSeek-V3 in your own training step: a zoo model, a recipe, optax and jit, in the two patterns flax users write.

The model is built under a recipe (here the study's `mla_moe_offload`: MLA's q, k, v and the routed experts' up
projections to pinned host memory, the rest recomputed); the stacks apply its checkpoint policy, so your step is
an ordinary step. DeepSeek-V3 adds two things to the loss and the update:

- the balance loss of every MoE layer (`total_balance_loss(aux)`, already weighted), added to the loss;
- the auxiliary-loss-free balance: each router's `RoutingBias` (not an `nnx.Param`: no gradient, no optimizer)
  moves after the update towards the under-loaded experts (`update_routing_bias(model, aux, rate)`).

Pattern (a), `nnx_step`: `nnx.jit` + `nnx.value_and_grad` + `nnx.Optimizer`, the model updated in place (the bias
too). Pattern (b), `functional_step`: `nnx.split(model, nnx.Param, ...)` into (graphdef, params, rest), a plain
`jax.jit` step that merges inside `jax.value_and_grad` (gradients with respect to `params` only) and hands back
new `params`, `rest` (the moved bias lives there) and optimizer state. Both compile once.

    python docs/examples/own_loop_deepseek_v3.py
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import recipes.deepseek_v3
import zoo
from zoo.models.deepseek_v3 import ROUTING_BIAS_RATE, total_balance_loss, update_routing_bias

cfg = zoo.models.DeepSeekV3Config.preset("tiny")          # 4 layers (2 dense, 2 MoE of 8 experts), float32
recipe = recipes.deepseek_v3.RECIPES["mla_moe_offload"]


def batch(step: int, size: int = 4, seq: int = 16) -> jax.Array:
    """Token ids [size, seq + 1]: counting sequences mod the vocabulary from a random start (easy to learn)."""
    start = np.random.default_rng(step).integers(cfg.vocab_size, size=(size, 1))
    return jnp.asarray((start + np.arange(seq + 1)) % cfg.vocab_size, jnp.int32)


def loss_fn(model: nnx.Module, tokens: jax.Array):
    """Next-token cross-entropy plus the MoE balance loss; the aux (per-layer expert loads) comes out too."""
    logits, aux = model(tokens[:, :-1], return_aux=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + total_balance_loss(aux), aux


# --8<-- [start:nnx]
# -- (a) nnx.jit + nnx.value_and_grad + nnx.Optimizer ------------------------------------------------------------
@nnx.jit
def nnx_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)   # grads of the nnx.Params
    optimizer.update(model, grads)
    update_routing_bias(model, aux, ROUTING_BIAS_RATE)    # in place: nnx.jit carries the new bias out
    return loss


def make_nnx() -> tuple[nnx.Module, nnx.Optimizer]:
    model = zoo.models.deepseek_v3(cfg, recipe=recipe, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    # Arrays made outside jit are not yet placed ("uncommitted"); under a recipe that offloads, a step's outputs
    # are (JAX commits the outputs of a program that moves values to host memory). Placing the state once here
    # gives the first step the inputs every later step gets, so the second step does not compile again
    # (docs/own-loop.md, "Compiling once").
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), jax.devices()[0]))
    return model, optimizer
# --8<-- [end:nnx]


# --8<-- [start:functional]
# -- (b) nnx.split / nnx.merge around jax.jit ----------------------------------------------------------------
graphdef = nnx.graphdef(zoo.models.deepseek_v3(cfg, recipe=recipe, rngs=nnx.Rngs(0)))   # the structure alone
tx = optax.adamw(3e-3)


def functional_loss(params, rest, tokens):
    return loss_fn(nnx.merge(graphdef, params, rest), tokens)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def functional_step(params, rest, opt_state, tokens):
    (loss, aux), grads = jax.value_and_grad(functional_loss, has_aux=True)(params, rest, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # The bias update on a model merged outside the gradient; its new state leaves the step as `rest`.
    updated = nnx.merge(graphdef, params, rest)
    update_routing_bias(updated, aux, ROUTING_BIAS_RATE)
    rest = nnx.state(updated, nnx.Not(nnx.Param))
    return params, rest, opt_state, loss


def make_functional():
    """(params, rest, optimizer state) of a fresh model: the step donates them, so each run gets its own."""
    _, params, rest = nnx.split(zoo.models.deepseek_v3(cfg, recipe=recipe, rngs=nnx.Rngs(0)), nnx.Param, ...)
    # Placed once (see make_nnx): the second step then gets inputs placed as the first step's were.
    return jax.device_put((params, rest, tx.init(params)), jax.devices()[0])
# --8<-- [end:functional]


def main(steps: int = 30) -> None:
    model, optimizer = make_nnx()
    losses_a = [float(nnx_step(model, optimizer, batch(step))) for step in range(steps)]
    params, rest, opt_state = make_functional()
    losses_b = []
    for step in range(steps):
        params, rest, opt_state, loss = functional_step(params, rest, opt_state, batch(step))
        losses_b.append(float(loss))
    for name, losses, state in (("nnx.jit", losses_a, nnx.state(model)), ("jax.jit + split", losses_b, rest)):
        bias = state["moe_layers"]["layers"]["mlp"]["gate"]["e_score_correction_bias"][...]
        print(f"{name:15s}  loss {losses[0]:.3f} -> {losses[-1]:.3f}; routing bias of the first MoE layer: "
              + " ".join(f"{b:+.3f}" for b in np.asarray(bias[0])))


if __name__ == "__main__":
    main()
