"""Plain-JAX baseline: a DeepSeek-V3-shaped slice (multi-head latent attention, and a mixture of experts dispatched
by sort + `jax.lax.ragged_dot`) of NL MoE layers, scanned under one checkpoint policy and trained with SGD; bf16.

    E=16 NL=3 XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        python -m bench.baselines.plain_jax_deepseek lowrank_offload 4

DeepSeek-V3's hidden sizes at seq 4096 with the experts cut to E (default 16), top-8; SMALL=1 a CPU smoke shape.
The router is sigmoid + plain top-k (the group limit is left out: its cost is negligible), with a shared expert.
Arguments: the policy (`POLICIES`) and the batch. Prints one JSON line (as `plain_jax_llama`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from bench.baselines.common import cp, measure, offload, report
from bench.baselines.plain_jax_llama import sgd_step

DT = jnp.bfloat16
STUDY = ["query_proj", "key_proj", "value_proj", "moe_mlpwi_0", "moe_mlpwi_1"]
LOWRANK = ["query_wa_proj", "kv_wa_proj", "moe_mlpwi_0", "moe_mlpwi_1"]
POLICIES = {"full": cp.nothing_saveable, "save_mla_moe": cp.save_only_these_names(*STUDY),
            "mla_moe_offload": offload(STUDY), "lowrank_offload": offload(LOWRANK),
            "save_lowrank": cp.save_only_these_names(*LOWRANK), "none": cp.everything_saveable}


@dataclasses.dataclass(frozen=True)
class Shape:
    seq: int
    dim: int
    heads: int
    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v: int
    mlp: int
    experts: int
    k: int

    @property
    def qk(self) -> int:
        return self.nope + self.rope


def shape_from_env() -> tuple[Shape, int, str | None]:
    if os.environ.get("SMALL"):
        s = Shape(64, 64, 4, 24, 16, 16, 8, 16, 32, 8, 2)
    else:
        s = Shape(4096, 7168, 128, 1536, 512, 128, 64, 128, 2048, int(os.environ.get("E", "16")), 8)
    return s, int(os.environ.get("NL", "3")), None if os.environ.get("SMALL") else "cudnn"


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(DT)


def rope(x, pos, dim: int):
    """Rotary embedding of the last axis (`dim` wide) of x [..., S, h, dim], base 10000."""
    half = dim // 2
    angle = pos[:, None] * (1.0 / (10000 ** (jnp.arange(half) / half)))[None]
    c, s = jnp.cos(angle)[:, None, :].astype(DT), jnp.sin(angle)[:, None, :].astype(DT)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * c - b * s, a * s + b * c], -1)


def layer(x, p, s: Shape, impl):
    b = x.shape[0]
    x = checkpoint_name(x, "decoder_layer_input")
    pos = jnp.arange(s.seq, dtype=jnp.float32)
    h = rms(x)
    # multi-head latent attention: low-rank q and kv, a shared rope key, values padded to the q/k head dim
    cq = rms(checkpoint_name(h @ p["wq_a"], "query_wa_proj"))
    q = (cq @ p["wq_b"]).reshape(b, s.seq, s.heads, s.qk)
    ckv = checkpoint_name(h @ p["wkv_a"], "kv_wa_proj")
    latent, k_rope = rms(ckv[..., :s.kv_rank]), ckv[..., s.kv_rank:]
    kv = (latent @ p["wkv_b"]).reshape(b, s.seq, s.heads, s.nope + s.v)
    k_nope, v = kv[..., :s.nope], kv[..., s.nope:]
    q = jnp.concatenate([q[..., :s.nope], rope(q[..., s.nope:], pos, s.rope)], -1)
    k_rope = jnp.broadcast_to(rope(k_rope[:, :, None, :], pos, s.rope), (b, s.seq, s.heads, s.rope))
    q = checkpoint_name(q, "query_proj")
    k = checkpoint_name(jnp.concatenate([k_nope, k_rope], -1), "key_proj")
    v = checkpoint_name(jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, s.qk - s.v))), "value_proj")
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)[..., :s.v]
    a = checkpoint_name(a.reshape(b, s.seq, s.heads * s.v), "attention_out")
    x = x + checkpoint_name(a @ p["wo"], "out_proj")
    # mixture of experts: sigmoid scores, top-k, weights normalised times 2.5; rows sorted by expert
    h = rms(x).reshape(b * s.seq, s.dim)
    scores = jax.nn.sigmoid((h @ p["router"]).astype(jnp.float32))
    w, idx = jax.lax.top_k(scores, s.k)
    w = (w / w.sum(-1, keepdims=True) * 2.5).astype(DT)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    inverse = jnp.argsort(order)
    rows = jnp.repeat(h, s.k, axis=0)[order]
    sizes = jnp.bincount(flat, length=s.experts).astype(jnp.int32)
    g = checkpoint_name(jax.lax.ragged_dot(rows, p["e_gate"], sizes), "moe_mlpwi_0")
    u = checkpoint_name(jax.lax.ragged_dot(rows, p["e_up"], sizes), "moe_mlpwi_1")
    y = checkpoint_name(jax.lax.ragged_dot(jax.nn.silu(g) * u, p["e_down"], sizes), "moe_mlpwo")
    y = (y[inverse].reshape(b * s.seq, s.k, s.dim) * w[..., None]).sum(1)
    sg = checkpoint_name(h @ p["s_gate"], "shared_mlpwi_0")
    su = checkpoint_name(h @ p["s_up"], "shared_mlpwi_1")
    y = y + checkpoint_name((jax.nn.silu(sg) * su) @ p["s_down"], "shared_mlpwo")
    return x + y.reshape(b, s.seq, s.dim)


def init(key, s: Shape, layers: int) -> dict:
    """Weights [layers, ...] drawn from N(0, 0.02^2), in bf16."""
    d, e, f = s.dim, s.experts, s.mlp
    shapes = dict(wq_a=(d, s.q_rank), wq_b=(s.q_rank, s.heads * s.qk), wkv_a=(d, s.kv_rank + s.rope),
                  wkv_b=(s.kv_rank, s.heads * (s.nope + s.v)), wo=(s.heads * s.v, d), router=(d, e),
                  e_gate=(e, d, f), e_up=(e, d, f), e_down=(e, f, d), s_gate=(d, f), s_up=(d, f), s_down=(f, d))
    keys = jax.random.split(key, len(shapes))
    return {n: (jax.random.normal(k, (layers, *sh), jnp.float32) * 0.02).astype(DT)
            for k, (n, sh) in zip(keys, shapes.items())}


def model_flops(s: Shape, batch: int, layers: int) -> float:
    """Active matmul FLOPs (k routed experts and the shared one per token) plus causal attention, times 3."""
    tokens = batch * s.seq
    d = s.dim
    active = (d * s.q_rank + s.q_rank * s.heads * s.qk + d * (s.kv_rank + s.rope)
              + s.kv_rank * s.heads * (s.nope + s.v) + s.heads * s.v * d + d * s.experts
              + s.k * 3 * d * s.mlp + 3 * d * s.mlp)
    attention = 2 * batch * s.seq * s.seq * s.heads * (s.qk + s.v) / 2
    return 3 * (2 * tokens * active + attention) * layers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", choices=sorted(POLICIES))
    ap.add_argument("batch", type=int, nargs="?", default=2)
    a = ap.parse_args(argv)
    s, layers, impl = shape_from_env()

    def loss(params, x):
        body = jax.checkpoint(lambda c, p: (layer(c, p, s, impl), None), policy=POLICIES[a.policy],
                              prevent_cse=False)
        y, _ = jax.lax.scan(body, x, params)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    def run():
        params = init(jax.random.key(0), s, layers)
        x = jax.random.normal(jax.random.key(1), (a.batch, s.seq, s.dim)).astype(DT)
        got = measure(jax.jit(sgd_step(loss)), params, x)
        got.pop("hlo")
        got.pop("temp_gib")
        return dict(tflops=round(model_flops(s, a.batch, layers) / got["step_s"] / 1e12, 1), **got)

    report(dict(shape="ds-slice", policy=a.policy, B=a.batch, L=layers, E=s.experts), run)


if __name__ == "__main__":
    main()
