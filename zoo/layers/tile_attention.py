"""Causal attention of one query tile against the keys up to it (blockwise attention, Liu and Abbeel 2023; the merge
of FlashAttention's split softmax): the tile's queries see its own keys causally and every key before the tile.

The tile's own keys are one kernel call (causal); the keys before it are one call per block of the tile's length, in
a loop that runs as many times as the tile has blocks before it (one program for every tile). Each call returns its
output and log-sum-exp, and they merge by the log-sum-exps into the tile's output and statistics, named
``attention_out`` and ``context`` as `zoo.layers.attention_kernel.causal_attention` names them. The backward hands
each call's kernel the merged output and statistics (all FlashAttention's backward reads besides q, k, v), so the
tile's gradient is the sum of the calls' and no [T, P] matrix is ever kept; every call reads and writes blocks of the
tile's length, so no kernel's workspace grows with the sequence (cuDNN's backward holds float32 sums the size of its
queries and its keys over the query heads). A model runs its attention this way over query tiles
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
        start: the tile's first position, a multiple of T (an int, or a traced int32 scalar: one loop body serves
            every tile).
        impl: the kernel, "xla", "cudnn" or "mosaic_cudnn" (`zoo.layers.attention_kernel.choose_impl`).
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
    t = q.shape[1]
    if isinstance(start, int) and start % t:
        raise ValueError(f"start={start} must be a multiple of the tile's length {t}: the keys before the tile are "
                         f"read in blocks of its length")
    start = jnp.asarray(start, jnp.int32)

    def block(x, j):   # block j of the whole sequence's keys or values, the tile's length
        return jax.lax.dynamic_slice_in_dim(x, j * t, t, axis=1)

    def forward(q, k, v, ka, va, start):
        with jax.named_scope(SCOPE), jax.named_scope(FORWARD):
            def before(j, acc):
                return merge(*acc, *attention_part(impl, q, block(ka, j), block(va, j), scale, causal=False))

            none = (jnp.zeros(q.shape, jnp.float32), jnp.full((q.shape[0], q.shape[2], t), -jnp.inf, jnp.float32))
            # summed in float32; no block before the first tile
            out_p, lse_p = jax.lax.fori_loop(0, start // t, before, none)
            out, lse = merge(*attention_part(impl, q, k, v, scale, causal=True), out_p, lse_p)
        out = name(out, "attention_out", BSH)
        lse = name(lse, "context", STATS_AXES)
        return out, (q, k, v, ka, va, start, out, lse)

    def backward(res, g):
        q, k, v, ka, va, start, out, lse = res
        with jax.named_scope(SCOPE):
            dq, dk, dv = attention_part_backward(impl, q, k, v, out, lse, g, scale, causal=True)

            def before(j, acc):
                dq, dka, dva = acc
                dq_j, dk_j, dv_j = attention_part_backward(impl, q, block(ka, j), block(va, j), out, lse, g, scale,
                                                           causal=False)
                return (dq + dq_j.astype(jnp.float32), jax.lax.dynamic_update_slice_in_dim(dka, dk_j, j * t, 1),
                        jax.lax.dynamic_update_slice_in_dim(dva, dv_j, j * t, 1))

            # the blocks from the tile on stay 0: the tile's own keys' gradients are dk and dv
            dq, dka, dva = jax.lax.fori_loop(0, start // t, before,
                                             (dq.astype(jnp.float32), jnp.zeros_like(ka), jnp.zeros_like(va)))
        return dq.astype(q.dtype), dk, dv, dka, dva, None

    @jax.custom_vjp
    def attend(q, k, v, ka, va, start):
        return forward(q, k, v, ka, va, start)[0]   # the forward rule's names, for an abstract trace

    attend.defvjp(forward, backward)
    return attend(q, k, v, k_all, v_all, start)
