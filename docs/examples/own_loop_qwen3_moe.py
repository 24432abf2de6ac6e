"""Qwen3-MoE in your own training step: a zoo model, a recipe, optax and jit, in the two patterns flax users write.

The model is built under a recipe (here `qkv_moe_offload`: the attention projections and the routed experts' up
projections to pinned host memory, the rest recomputed); its stacks apply the recipe's checkpoint policy. The loss
adds every MoE layer's balance loss (Switch Transformer's, already weighted by `balance_loss_weight`), read from
the aux the model returns with `return_aux=True`.

Pattern (a), `nnx_step`: `nnx.jit` + `nnx.value_and_grad` + `nnx.Optimizer`, the model updated in place.
Pattern (b), `functional_step`: `nnx.split(model, nnx.Param, ...)` into (graphdef, params, rest), a plain
`jax.jit` step that merges inside `jax.value_and_grad` (gradients with respect to `params` only) and returns new
`params` and optimizer state. Both compile once.

    python docs/examples/own_loop_qwen3_moe.py
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import recipes.qwen3_moe
from zoo.layers.moe import total_balance_loss
from zoo.models.qwen3_moe import Qwen3MoeConfig, qwen3_moe

cfg = Qwen3MoeConfig.preset("tiny")            # 4 layers (2 dense, 2 MoE of 8 experts, top-2), float32
recipe = recipes.qwen3_moe.RECIPES["qkv_moe_offload"]


def batch(step: int, size: int = 4, seq: int = 16) -> jax.Array:
    """Token ids [size, seq + 1]: counting sequences mod the vocabulary from a random start (easy to learn)."""
    start = np.random.default_rng(step).integers(cfg.vocab_size, size=(size, 1))
    return jnp.asarray((start + np.arange(seq + 1)) % cfg.vocab_size, jnp.int32)


def loss_fn(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    logits, aux = model(tokens[:, :-1], return_aux=True)   # aux: {stack: MoEAux of its layers} ({} if dense)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + total_balance_loss(aux)


# -- (a) nnx.jit + nnx.value_and_grad + nnx.Optimizer ------------------------------------------------------------
@nnx.jit
def nnx_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def make_nnx() -> tuple[nnx.Module, nnx.Optimizer]:
    model = qwen3_moe(cfg, recipe=recipe, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    # Arrays made outside jit are not yet placed ("uncommitted"); under a recipe that offloads, a step's outputs
    # are (JAX commits the outputs of a program that moves values to host memory). Placing the state once here
    # gives the first step the inputs every later step gets, so the second step does not compile again
    # (docs/own-loop.md, "Compiling once").
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), jax.devices()[0]))
    return model, optimizer


# -- (b) nnx.split / nnx.merge around jax.jit ----------------------------------------------------------------
graphdef = nnx.graphdef(qwen3_moe(cfg, recipe=recipe, rngs=nnx.Rngs(0)))   # the structure alone
tx = optax.adamw(3e-3)


def functional_loss(params, rest, tokens):
    return loss_fn(nnx.merge(graphdef, params, rest), tokens)


@functools.partial(jax.jit, donate_argnums=(0, 2))
def functional_step(params, rest, opt_state, tokens):
    loss, grads = jax.value_and_grad(functional_loss)(params, rest, tokens)   # w.r.t. params only
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state, loss


def make_functional():
    """(params, rest, optimizer state) of a fresh model: the step donates them, so each run gets its own."""
    _, params, rest = nnx.split(qwen3_moe(cfg, recipe=recipe, rngs=nnx.Rngs(0)), nnx.Param, ...)
    # Placed once (see make_nnx): the second step then gets inputs placed as the first step's were.
    return jax.device_put((params, rest, tx.init(params)), jax.devices()[0])


def main(steps: int = 30) -> None:
    model, optimizer = make_nnx()
    losses_a = [float(nnx_step(model, optimizer, batch(step))) for step in range(steps)]
    params, rest, opt_state = make_functional()
    losses_b = []
    for step in range(steps):
        params, rest, opt_state, loss = functional_step(params, rest, opt_state, batch(step))
        losses_b.append(float(loss))
    for name, losses in (("nnx.jit", losses_a), ("jax.jit + split", losses_b)):
        print(f"{name:15s}  loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
