"""Plain-JAX baseline for long context: a Llama-shaped scanned stack (SGD, loss mean(y^2)) whose attention kernel's
residuals carry the name "context", so a checkpoint policy can keep or offload them instead of running the
attention forward again in the backward pass. No zoo code: what a JAX user writes by hand.

    SEQ=32768 NL=8 python bench/baselines/plain_jax_llama_ctx.py ctx_offload [BATCH]

The wrapper is a custom_vjp whose forward rule runs jax.vjp of jax.nn.dot_product_attention and names every
residual leaf that is not q, k or v (cuDNN: the output and the softmax statistics), the output included: the output
projection's input, recomputed in the backward pass otherwise, then reads the saved value. Prints one JSON line
(the attention forward calls of the compiled program, `fmha_fwd_calls`, among the figures). SMALL=1: tiny shapes,
float32, XLA attention (checks the script on a CPU).
"""
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

POLICY = sys.argv[1]
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
SMALL = bool(os.environ.get("SMALL"))
D, H, KV, HD, F = (64, 4, 2, 16, 128) if SMALL else (4096, 32, 8, 128, 14336)   # Llama 3.1 8B's layer
S = int(os.environ.get("SEQ", "64" if SMALL else "32768"))
L = int(os.environ.get("NL", "8"))
DT = jnp.float32 if SMALL else jnp.bfloat16
IMPL = "xla" if SMALL else "cudnn"
_structure = {}


def _attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=IMPL)


@jax.custom_vjp
def attention(q, k, v):
    return _attend(q, k, v)


def _attention_fwd(q, k, v):
    out, vjp_fn = jax.vjp(_attend, q, k, v)
    leaves, _structure["tree"] = jax.tree.flatten(vjp_fn)
    named = {}

    def keep(x):   # one named value per residual that is not an input; the output is the same value everywhere
        if any(x is a for a in (q, k, v)):
            return x
        return named.setdefault(id(x), checkpoint_name(x, "context"))

    out = keep(out)
    return out, [keep(x) for x in leaves]


def _attention_bwd(leaves, g):
    return jax.tree.unflatten(_structure["tree"], leaves)(g)


attention.defvjp(_attention_fwd, _attention_bwd)


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(DT)


def layer(x, p):
    x = checkpoint_name(x, "decoder_layer_input")
    h = rms(x)
    q = checkpoint_name(h @ p["wq"], "query_proj").reshape(B, S, H, HD)
    k = checkpoint_name(h @ p["wk"], "key_proj").reshape(B, S, KV, HD)
    v = checkpoint_name(h @ p["wv"], "value_proj").reshape(B, S, KV, HD)
    a = checkpoint_name(attention(q, k, v).reshape(B, S, H * HD), "attn_out")
    x = x + checkpoint_name(a @ p["wo"], "out_proj")
    h = rms(x)
    gate, up = checkpoint_name(h @ p["w1"], "mlpwi_0"), checkpoint_name(h @ p["w3"], "mlpwi_1")
    return x + checkpoint_name((jax.nn.silu(gate) * up) @ p["w2"], "mlpwo")


QKV = ["query_proj", "key_proj", "value_proj"]
MATMULS = QKV + ["attn_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"]


def _policy(save=(), offload=()):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(offload),
        offload_src="device", offload_dst="pinned_host")


POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "ctx_save": _policy(save=["context"]),
    "ctx_offload": _policy(offload=["context"]),
    "save_qkv": _policy(save=QKV),
    "offload_qkv": _policy(offload=QKV),
    "offload_qkv_ctx": _policy(offload=QKV + ["context"]),
    "minimal": _policy(save=MATMULS),
    "minimal_ctx": _policy(save=MATMULS + ["context"]),
}


def init(key):
    shapes = dict(wq=(D, H * HD), wk=(D, KV * HD), wv=(D, KV * HD), wo=(H * HD, D), w1=(D, F), w3=(D, F),
                  w2=(F, D))
    keys = jax.random.split(key, len(shapes))
    return {n: (jax.random.normal(k, (L,) + s, jnp.float32) * 0.02).astype(DT)
            for k, (n, s) in zip(keys, shapes.items())}


def loss(params, x):
    body = jax.checkpoint(lambda c, p: (layer(c, p), None), policy=POLICIES[POLICY], prevent_cse=False)
    y, _ = jax.lax.scan(body, x, params)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


@jax.jit
def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads)


def main():
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, S, D)).astype(DT)
    try:
        compiled = step.lower(params, x).compile()
        analysis, text = compiled.memory_analysis(), compiled.as_text()
        for _ in range(2):
            value, params = compiled(params, x)
        value.block_until_ready()
        n = int(os.environ.get("STEPS", "4"))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            value, params = compiled(params, x)
            value.block_until_ready()
            times.append(time.perf_counter() - t)
        step_s = sorted(times)[n // 2]
        matmul = 2 * B * S * (D * (H * HD + 2 * KV * HD) + H * HD * D + 3 * D * F) * 3 * L
        attn = 2 * 2 * B * S * S * H * HD / 2 * 3 * L
        stats = jax.devices()[0].memory_stats() or {}
        print(json.dumps(dict(policy=POLICY, B=B, S=S, L=L, flags=os.environ.get("XLA_FLAGS", ""),
                              step_s=round(step_s, 4), tflops=round((matmul + attn) / step_s / 1e12, 1),
                              peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
                              temp_gib=round(analysis.temp_size_in_bytes / 2**30, 2),
                              host_temp_gib=round(getattr(analysis, "host_temp_size_in_bytes", 0) / 2**30, 2),
                              fmha_fwd_calls=text.count('custom_call_target="__cudnn$fmhaSoftmax"'),
                              loss=float(value))))
    except Exception as e:  # out of memory and friends are data
        print(json.dumps(dict(policy=POLICY, B=B, S=S, L=L, error=f"{type(e).__name__}: {str(e)[:300]}")))


if __name__ == "__main__":
    main()
