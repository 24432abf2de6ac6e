"""Causal attention of one query tile against the keys up to it (blockwise attention, Liu and Abbeel 2023; the merge
of FlashAttention's split softmax): the tile's queries see its own keys causally and every key before the tile.

The two parts are two kernel calls, the diagonal block (causal) and the prefix (the whole sequence's keys, the
kernel told to read only the first `start`: one program for every tile), each returning its output and
log-sum-exp; they merge by the log-sum-exps into the tile's output and statistics, named ``attention_out`` and
``context`` as `zoo.layers.attention_kernel.causal_attention` names them. The backward hands each part's kernel the
merged output and statistics (all FlashAttention's backward reads besides q, k, v), so the tile's gradient is the
sum of the parts' and no [T, P] matrix is ever kept. A model runs its attention this way over query tiles
(`zoo.layers.query_tiles`) so that only one tile's queries, outputs and their gradients exist at a time.
"""
from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from zoo.layers.attention_kernel import FORWARD, SCOPE, STATS_AXES, attention_part, attention_part_backward
from zoo.sharding import BSH
from zoo.tags import name


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The softmax over two key blocks from each block's own: each output weighted by exp(its lse - the joint lse).

    Args:
        out_a: the first block's output [B, T, H, d].
        lse_a: its log-sum-exp [B, H, T] (float32; -inf for a row that saw no key).
        out_b: the second block's output [B, T, H, d].
        lse_b: its log-sum-exp [B, H, T].

    Returns:
        (out [B, T, H, d] in out_a's dtype, lse [B, H, T] float32) of the softmax over both blocks.
    """
    lse = jnp.logaddexp(lse_a, lse_b)

    def weighted(out, part):
        w = einops.rearrange(jnp.exp(part - lse), "b h t -> b t h 1")
        return out.astype(jnp.float32) * w

    return (weighted(out_a, lse_a) + weighted(out_b, lse_b)).astype(out_a.dtype), lse


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_all: jax.Array, v_all: jax.Array,
                     start: jax.Array | int, *, impl: str, scale: float | None = None) -> jax.Array:
    """Causal attention of a query tile at positions start .. start + T - 1: softmax over the keys before the tile
    (all visible) and the tile's own (causal), with grouped-query heads.

    Args:
        q: the tile's queries [B, T, H, d].
        k: the tile's keys [B, T, Hkv, d] (Hkv divides H).
        v: the tile's values [B, T, Hkv, d].
        k_all: the keys of the whole sequence [B, S, Hkv, d]; the first `start` are the tile's prefix.
        v_all: their values [B, S, Hkv, d].
        start: the tile's first position (an int, or a traced int32 scalar: one loop body serves every tile).
        impl: the kernel, "xla", "cudnn" or "mosaic_cudnn" (`zoo.layers.attention_kernel.choose_impl`; the prefix
            part of mosaic_cudnn runs cuDNN's forward, which takes a key length).
        scale: the softmax scale (default d ** -0.5).

    Returns:
        [B, T, H, d] in q's dtype: rows start .. start + T - 1 of `causal_attention` over the whole sequence.

    Emits:
        `attention_out` (the tile's output) and `context` (its float32 log-sum-exp [B, H, T]), the merged softmax's,
        inside a `jax.custom_vjp`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from zoo.layers import causal_attention, prefix_attention
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
        >>> whole = causal_attention(q, k, v, impl="xla")
        >>> tile = prefix_attention(q[:, 4:], k[:, 4:], v[:, 4:], k, v, 4, impl="xla")
        >>> bool(jnp.allclose(tile, whole[:, 4:], atol=1e-5))
        True
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    start = jnp.asarray(start, jnp.int32)

    def forward(q, k, v, ka, va, start):
        with jax.named_scope(SCOPE), jax.named_scope(FORWARD):
            out_d, lse_d = attention_part(impl, q, k, v, scale, causal=True)
            out_p, lse_p = attention_part(impl, q, ka, va, scale, causal=False, kv_len=start)
            seen = start > 0   # the first tile has no prefix: its part is not defined, and counts for nothing
            out, lse = merge(out_d, lse_d, jnp.where(seen, out_p, 0), jnp.where(seen, lse_p, -jnp.inf))
        out = name(out, "attention_out", BSH)
        lse = name(lse, "context", STATS_AXES)
        return out, (q, k, v, ka, va, start, out, lse)

    def backward(res, g):
        q, k, v, ka, va, start, out, lse = res
        with jax.named_scope(SCOPE):
            dq, dk, dv = attention_part_backward(impl, q, k, v, out, lse, g, scale, causal=True)
            dq_p, dka, dva = attention_part_backward(impl, q, ka, va, out, lse, g, scale, causal=False, kv_len=start)
            before = (jnp.arange(ka.shape[1]) < start)[None, :, None, None]   # the prefix's keys: the rest is 0
            dq = jnp.where(start > 0, dq.astype(jnp.float32) + dq_p.astype(jnp.float32), dq).astype(q.dtype)
            dka, dva = jnp.where(before, dka, 0).astype(ka.dtype), jnp.where(before, dva, 0).astype(va.dtype)
        return dq, dk, dv, dka, dva, None

    @jax.custom_vjp
    def attend(q, k, v, ka, va, start):
        return forward(q, k, v, ka, va, start)[0]   # the forward rule's names, for an abstract trace

    attend.defvjp(forward, backward)
    return attend(q, k, v, k_all, v_all, start)
