"""Grouped-query attention in plain JAX whose residuals are its output and log-sum-exp (FlashAttention-2's backward,
Dao 2023, without the tiling): the backward recomputes p = exp(s - lse), so nothing of size [B, H, Sq, Sk] is saved.
Causal (query i sees keys 0..i, Sq = Sk) by default; `causal=False` lets every query see every key (a query tile
against the keys before it, `zoo.layers.tile_attention`). Logits, softmax and statistics are float32; query head h
attends with key/value head h // (H // Hkv).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


def _stat_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _logits(q, k, scale, causal: bool = True, kv_len=None):
    """Scaled logits [B, Hkv, G, Sq, Sk] in float32 (float64 for float64 inputs), causally masked if `causal`, else
    the keys from `kv_len` on masked (None: none)."""
    qg = _grouped(q, k.shape[2])
    dt = _stat_dtype(q.dtype)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=dt) * jnp.asarray(scale, dt)
    if not causal:
        return s if kv_len is None else jnp.where(jnp.arange(k.shape[1]) < kv_len, s, jnp.finfo(dt).min)
    n = q.shape[1]
    mask = jnp.tril(jnp.ones((n, n), dtype=bool))
    return jnp.where(mask, s, jnp.finfo(dt).min)


def forward(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool = True, kv_len=None
            ) -> tuple[jax.Array, jax.Array]:
    """(out [B, Sq, H, dv] in q's dtype, lse [B, H, Sq] in float32). Not `causal`: the first `kv_len` keys seen
    (None: all)."""
    b, n, h, _ = q.shape
    s = _logits(q, k, scale, causal, kv_len)
    lse = jax.nn.logsumexp(s, axis=-1)                                  # [B, Hkv, G, S]
    p = jnp.exp(s - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(b, n, h, v.shape[-1]).astype(q.dtype)
    return out, lse.reshape(b, h, n)


def backward(q, k, v, out, lse, g, scale: float, causal: bool = True, kv_len=None):
    """(dq, dk, dv) of `forward` for the output cotangent g [B, Sq, H, dv], from the saved out and lse (or another
    forward's: the output and log-sum-exp of the whole softmax this call's keys are a part of)."""
    b, n, h, dq_dim = q.shape
    kv = k.shape[2]
    dt = _stat_dtype(q.dtype)
    s = _logits(q, k, scale, causal, kv_len)
    p = jnp.exp(s - lse.reshape(b, kv, h // kv, n)[..., None])          # [B, Hkv, G, S, S]
    gg = _grouped(g, kv)                                                # [B, S, Hkv, G, dv]
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), gg, preferred_element_type=dt)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", gg, v, preferred_element_type=dt)
    rows = jnp.einsum("bqkgd,bqkgd->bkgq", gg.astype(dt), _grouped(out, kv).astype(dt))
    ds = p * (dp - rows[..., None]) * jnp.asarray(scale, dt)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(dt)).reshape(b, n, h, dq_dim)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, _grouped(q, kv).astype(dt))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
