"""Your own training loop with a zoo recipe: the recipe is a JAX checkpoint policy, nothing more.

Your model names its intermediates with `zoo.tags.name` (or `jax.ad_checkpoint.checkpoint_name` with the same
names), your layer goes under `jax.checkpoint(policy=recipe.policy())` (or `nnx.remat(policy=...)`), and your
own `jax.jit` step trains it. Here: a two-layer pre-norm attention block in plain JAX, scanned over layers,
with the study's Llama recipe (q, k, v to pinned host memory, everything else recomputed).

    python docs/examples/custom_loop.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import recipes.llama3
from zoo.plan import measure
from zoo.tags import name

VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2
recipe = recipes.llama3.RECIPES["qkv_offload"]


def init(key):
    k = jax.random.split(key, 6)
    layer = lambda k, shape: jax.random.normal(k, (LAYERS, *shape)) / np.sqrt(shape[0])  # noqa: E731
    return {"embed": jax.random.normal(k[0], (VOCAB, DIM)),
            "layers": {"wq": layer(k[1], (DIM, DIM)), "wk": layer(k[2], (DIM, DIM)), "wv": layer(k[3], (DIM, DIM)),
                       "wo": layer(k[4], (DIM, DIM))},
            "head": jax.random.normal(k[5], (DIM, VOCAB)) / np.sqrt(DIM)}


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def block(p, x):
    x = name(x, "decoder_layer_input")                 # first line of the rematerialized body (jax#23869)
    h = rms(x)
    split = lambda t: t.reshape(*t.shape[:2], HEADS, DIM // HEADS)  # noqa: E731
    q = name(split(h @ p["wq"]), "query_proj")
    k = name(split(h @ p["wk"]), "key_proj")
    v = name(split(h @ p["wv"]), "value_proj")
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return x + name(o.reshape(x.shape) @ p["wo"], "out_proj")


# The recipe goes here: your own jax.checkpoint of your own layer.
layer = jax.checkpoint(block, policy=recipe.policy(), prevent_cse=False)


def loss_fn(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), x, params["layers"])
    logp = jax.nn.log_softmax(rms(x) @ params["head"])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


optimizer = optax.adamw(1e-2)


@jax.jit
def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch(step: int, size: int = 8, seq: int = 32) -> jnp.ndarray:
    """Counting sequences mod VOCAB from a random start: easy to learn."""
    start = np.random.default_rng(step).integers(VOCAB, size=(size, 1))
    return jnp.asarray((start + np.arange(seq + 1)) % VOCAB, jnp.int32)


def main(steps: int = 30) -> list[float]:
    params = init(jax.random.key(0))
    # What JAX saves for the backward pass under the recipe: q, k and v on the host, stacked over the layers.
    host = [r.shape for r in measure.residuals(loss_fn, params, batch(0)) if r.host]
    on_cpu = jax.devices()[0].platform == "cpu"   # no pinned host memory there: the offload compiles, nothing moves
    print("offloaded by the recipe (on the CPU nothing moves: they stay in its memory):" if on_cpu else
          "saved in pinned host memory:", host)
    opt_state = optimizer.init(params)
    losses = []
    for step in range(steps):
        params, opt_state, loss = train_step(params, opt_state, batch(step))
        losses.append(float(loss))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps")
    return losses


if __name__ == "__main__":
    main()
