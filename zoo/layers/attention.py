"""Grouped-query attention (Ainslie et al., 2023) as in Llama 3.1.

x -> q [B,S,H,d], k and v [B,S,Hkv,d]; RoPE on q and k; causal softmax attention through
`jax.nn.dot_product_attention` (cuDNN flash attention on GPUs when asked for, XLA elsewhere); output projection.
Tags: query_proj, key_proj, value_proj (after RoPE), attention_out, out_proj.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.tagged import TaggedLayer
from zoo.layers.linear import projection
from zoo.layers.rope import Rope
from zoo.sharding import BSD, BSH, BSK
from zoo.tags import name

Implementation = Literal["xla", "cudnn"] | None


def causal_attention(q, k, v, *, scale: float | None = None, implementation: Implementation = None):
    """Causal attention over [B,S,H,d] queries and [B,S,Hkv,d] keys/values (Hkv divides H)."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)


def positions_for(x: jax.Array) -> jax.Array:
    """Positions 0..S-1 of a [B,S,...] input (training on packed, unpadded sequences)."""
    return jnp.arange(x.shape[1], dtype=jnp.int32)


class Attention(TaggedLayer):
    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: Rope,
                 dtype=jnp.float32, param_dtype=jnp.float32, implementation: Implementation = None,
                 rngs: nnx.Rngs):
        self.dim, self.dtype = dim, dtype
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = projection("bsd,dhk->bshk", (dim, num_heads, head_dim), ("embed", "heads", "head_dim"), n_in=1, **common)
        self.k_proj = projection("bsd,dhk->bshk", (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), n_in=1, **common)
        self.v_proj = projection("bsd,dhk->bshk", (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), n_in=1, **common)
        self.o_proj = projection("bshk,hkd->bsd", (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), n_in=2, **common)
        self.rope = rope
        self.implementation = implementation

    def __call__(self, x: jax.Array) -> jax.Array:
        pos = positions_for(x)
        q = name(self.rope(self.q_proj(x), pos), "query_proj", BSH)
        k = name(self.rope(self.k_proj(x), pos), "key_proj", BSK)
        v = name(self.v_proj(x), "value_proj", BSK)
        out = name(causal_attention(q, k, v, implementation=self.implementation), "attention_out", BSH)
        return name(self.o_proj(out), "out_proj", BSD)
