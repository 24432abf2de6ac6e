"""The attention kernel's named residuals on a GPU: cuDNN's wrapper (zoo.layers.attention_kernel) against the zoo's
XLA kernel on the same random inputs, forward and gradients, for a GQA shape and an MLA shape (q/k head dim 192,
values 128), and what a remat under `context_offload` leaves in the compiled program (attention forward calls).

    python -m bench.ctx_kernel_check

Prints one JSON line per case: relative errors of the output and of dq, dk, dv (bf16 inputs, float32 reference
arithmetic inside both kernels), and the cuDNN forward calls of a rematerialized step under `full` and under a policy
keeping attention_out and context.
"""
import json

import jax
import jax.numpy as jnp

import zoo
from zoo.layers.attention_kernel import causal_attention

FWD_CALL = 'custom_call_target="__cudnn$fmhaSoftmax"'


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def case(name, b, s, h, kv, dq, dv):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, s, h, dq), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, kv, dq), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, kv, dv), jnp.bfloat16)
    g = jax.random.normal(ks[3], (b, s, h, dv), jnp.bfloat16)
    out = {}
    for impl in ("cudnn", "xla"):
        f = jax.jit(lambda q, k, v, impl=impl: jax.vjp(lambda *a: causal_attention(*a, impl=impl), q, k, v))
        o, vjp = f(q, k, v)
        out[impl] = (o, *vjp(g))
    errs = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), out["cudnn"], out["xla"])}
    calls = {}
    for label, recipe in (("full", zoo.Recipe.full()),
                          ("context", zoo.Recipe("c", offload=("attention_out", "context")))):
        body = jax.checkpoint(lambda q, k, v: jnp.sum(jnp.sin(causal_attention(q, k, v, impl="cudnn")
                                                              .astype(jnp.float32))), policy=recipe.policy())
        text = jax.jit(jax.grad(body, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
        calls[label] = text.count(FWD_CALL)
    print(json.dumps(dict(case=name, shape=[b, s, h, kv, dq, dv], rel_err=errs, fmha_fwd_calls=calls)), flush=True)


if __name__ == "__main__":
    case("gqa", 1, 2048, 8, 2, 128, 128)
    case("mla", 1, 2048, 8, 8, 192, 128)
