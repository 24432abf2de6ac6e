"""Plain-JAX baseline: a Llama-shaped stack (no embedding or head) scanned over layers under one checkpoint
policy, trained with SGD; bf16 weights and activations, cuDNN attention on the GPU.

    SHAPE=405b NL=3 XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        python -m bench.baselines.plain_jax_llama offload_qkv 2

SHAPE: 8b | 405b (seq 8192); SMALL=1 a CPU smoke shape (seq 128, dim 64); NL: layers (default 8). Arguments:
the policy (`POLICIES`) and the batch. Prints one JSON line: step seconds, model TFLOP/s (matmuls and causal
attention, forward and backward), peak HBM, XLA's temporaries and host temporaries, the loss.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from bench.baselines.common import cp, measure, offload, report

DT = jnp.bfloat16
QKV = ["query_proj", "key_proj", "value_proj"]
MATMULS = QKV + ["attn_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"]
POLICIES = {
    "full": cp.nothing_saveable,
    "save_qkv": cp.save_only_these_names(*QKV),
    "offload_qkv": offload(QKV),
    "offload_qkv_out": offload(QKV + ["out_proj", "attn_out"]),
    "minimal": cp.dots_with_no_batch_dims_saveable,
    "offload_minimal": offload(MATMULS),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    seq: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int


SHAPES = {"small": Shape(128, 64, 4, 2, 16, 128), "8b": Shape(8192, 4096, 32, 8, 128, 14336),
          "405b": Shape(8192, 16384, 128, 8, 128, 53248)}


def shape_from_env() -> tuple[str, Shape, int, str | None]:
    """(name, shape, layers, attention implementation) from SHAPE, SMALL and NL."""
    name = "small" if os.environ.get("SMALL") else os.environ.get("SHAPE", "8b")
    return name, SHAPES[name], int(os.environ.get("NL", "8")), None if os.environ.get("SMALL") else "cudnn"


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(DT)


def layer(x, p, s: Shape, impl, gather=lambda w: w):
    """One decoder layer; `gather` is applied to each weight before use (FSDP's all-gather, or nothing)."""
    b = x.shape[0]
    x = checkpoint_name(x, "decoder_layer_input")   # the first line: naming the layer's output offloads nothing
    h = rms(x)
    q = checkpoint_name(h @ gather(p["wq"]), "query_proj").reshape(b, s.seq, s.heads, s.head_dim)
    k = checkpoint_name(h @ gather(p["wk"]), "key_proj").reshape(b, s.seq, s.kv_heads, s.head_dim)
    v = checkpoint_name(h @ gather(p["wv"]), "value_proj").reshape(b, s.seq, s.kv_heads, s.head_dim)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    a = checkpoint_name(a.reshape(b, s.seq, s.heads * s.head_dim), "attn_out")
    x = x + checkpoint_name(a @ gather(p["wo"]), "out_proj")
    h = rms(x)
    g = checkpoint_name(h @ gather(p["w1"]), "mlpwi_0")
    u = checkpoint_name(h @ gather(p["w3"]), "mlpwi_1")
    return x + checkpoint_name((jax.nn.silu(g) * u) @ gather(p["w2"]), "mlpwo")


def init(key, s: Shape, layers: int) -> dict:
    """Weights [layers, ...] drawn from N(0, 0.02^2), in bf16."""
    hd = s.heads * s.head_dim
    shapes = dict(wq=(s.dim, hd), wk=(s.dim, s.kv_heads * s.head_dim), wv=(s.dim, s.kv_heads * s.head_dim),
                  wo=(hd, s.dim), w1=(s.dim, s.mlp), w3=(s.dim, s.mlp), w2=(s.mlp, s.dim))
    keys = jax.random.split(key, len(shapes))
    return {n: (jax.random.normal(k, (layers, *sh), jnp.float32) * 0.02).astype(DT)
            for k, (n, sh) in zip(keys, shapes.items())}


def loss_fn(policy, s: Shape, impl, gather=lambda w: w):
    """Mean square of the stack's output: the layers scanned under `jax.checkpoint(policy)`."""
    def loss(params, x):
        body = jax.checkpoint(lambda c, p: (layer(c, p, s, impl, gather), None), policy=policy, prevent_cse=False)
        y, _ = jax.lax.scan(body, x, params)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))
    return loss


def sgd_step(loss):
    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return value, jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads)
    return step


def model_flops(s: Shape, batch: int, layers: int) -> float:
    """Matmul and causal-attention FLOPs of a training step (forward + backward = 3x forward)."""
    tokens = batch * s.seq
    hd = s.heads * s.head_dim
    matmuls = 2 * tokens * (s.dim * (hd + 2 * s.kv_heads * s.head_dim) + hd * s.dim + 3 * s.dim * s.mlp)
    attention = 2 * 2 * batch * s.seq * s.seq * hd / 2
    return (matmuls + attention) * 3 * layers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", choices=sorted(POLICIES))
    ap.add_argument("batch", type=int, nargs="?", default=2)
    a = ap.parse_args(argv)
    name, s, layers, impl = shape_from_env()

    def run():
        params = init(jax.random.key(0), s, layers)
        x = jax.random.normal(jax.random.key(1), (a.batch, s.seq, s.dim)).astype(DT)
        got = measure(jax.jit(sgd_step(loss_fn(POLICIES[a.policy], s, impl))), params, x)
        got.pop("hlo")
        return dict(tflops=round(model_flops(s, a.batch, layers) / got["step_s"] / 1e12, 1), **got)

    report(dict(shape=name, policy=a.policy, B=a.batch, L=layers), run)


if __name__ == "__main__":
    main()
