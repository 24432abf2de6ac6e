"""Grouped-query attention (Ainslie et al., 2023, arXiv:2305.13245).

x -> q [B,S,H,d], k and v [B,S,Hkv,d]; optionally (`qk_norm_eps`, arXiv:2505.09388) an RMSNorm over each head of q and
of k; RoPE on q and k; causal attention (`zoo.layers.attention_kernel`, the kernel chosen once for the device present;
`attention_impls(model)` says which); output projection. Tags: query_proj, key_proj (after the norm and RoPE),
value_proj, attention_out and context (the kernel's), out_proj.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.checks import check_positive
from zoo.layers.attention_kernel import AttentionChoice, Implementation, causal_attention, choose_impl
from zoo.layers.linear import projection
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import Rope
from zoo.layers.tagged import TaggedLayer
from zoo.layers.tile_attention import prefix_attention
from zoo.sharding import BSD, BSH, BSK
from zoo.tags import name


def kernel_head_dim(cfg: Any) -> int:
    """The head dim the attention kernel sees for a model config (the config says: `attention_head_dim()`)."""
    return cfg.attention_head_dim()


def attention_impls(model: nnx.Module) -> dict[str, AttentionChoice]:
    """{path of each attention layer in `model`: the kernel it runs (chosen when it was built)}."""
    out = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and hasattr(module, "attention_choice"):
            out["/".join(map(str, path))] = module.attention_choice()
    return out


def positions_for(x: jax.Array) -> jax.Array:
    """Positions 0..S-1 of a [B,S,...] input (training on packed, unpadded sequences)."""
    return jnp.arange(x.shape[1], dtype=jnp.int32)


class _ChosenKernel(TaggedLayer):
    """What the attention layers share: the kernel they run, chosen once when built (`kernel`, for the first
    device) from `implementation`, `dtype` and `kernel_head_dim`."""

    def attention_choice(self, device: jax.Device | None = None) -> AttentionChoice:
        """The kernel this layer runs: chosen when it was built, for the first device (or for `device`)."""
        if device is None:
            return self.kernel
        return choose_impl(self.implementation, dtype=self.dtype, head_dim=self.kernel_head_dim, device=device)


class Attention(_ChosenKernel):
    """Grouped-query attention (GQA; Ainslie et al., 2023): `num_heads` query heads share `num_kv_heads` key and
    value heads; with `qk_norm_eps`, Qwen3's RMSNorm over each query and key head before RoPE (Qwen Team, 2025);
    rotary position embeddings (Su et al.) on q and k; causal attention; the output projection. No biases.

    Args:
        dim: the model width D.
        num_heads: the query heads H.
        num_kv_heads: the key and value heads Hkv (they divide H).
        head_dim: the width of each head.
        rope: the rotary embedding of q and k (`zoo.layers.Rope`, of `head_dim` dimensions).
        dtype: the computation's dtype.
        param_dtype: the dtype the kernels are stored in.
        implementation: the attention kernel, "xla", "cudnn" or None (chosen for the first device, once, when the
            layer is built: `attention_choice()` says which and why).
        qk_norm_eps: None for no q/k norm, else the eps of the per-head RMSNorm of q and of k.
        query_tiles: a block runs this attention over this many tiles of queries, one at a time, each against the
            keys up to it (`zoo.layers.query_tiles`: one tile's queries and outputs in memory at once); 1: whole.
        rngs: the random generators of the kernels' initialization.

    Emits:
        `query_proj` and `key_proj` (after the norm and RoPE), `value_proj`, `attention_out` and `context` (the
        kernel's output and softmax statistics), `out_proj`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import Attention, Rope
        >>> attn = Attention(dim=16, num_heads=4, num_kv_heads=2, head_dim=8, rope=Rope(dim=8), rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((1, 6, 16))).shape
        (1, 6, 16)
        >>> list(attn.tag_shapes(batch=1, seq=6))
        ['query_proj', 'key_proj', 'value_proj', 'attention_out', 'context', 'out_proj']
    """

    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: Rope,
                 dtype=jnp.float32, param_dtype=jnp.float32, implementation: Implementation = None,
                 qk_norm_eps: float | None = None, query_tiles: int = 1, rngs: nnx.Rngs):
        check_positive("query_tiles", query_tiles, optional=False)
        self.dim, self.dtype, self.query_tiles = dim, dtype, query_tiles
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q_proj = projection("bsd,dhk->bshk", (dim, num_heads, head_dim), q_axes, n_in=1, **common)
        self.k_proj = projection("bsd,dhk->bshk", (dim, num_kv_heads, head_dim), kv_axes, n_in=1, **common)
        self.v_proj = projection("bsd,dhk->bshk", (dim, num_kv_heads, head_dim), kv_axes, n_in=1, **common)
        self.o_proj = projection("bshk,hkd->bsd", (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), n_in=2,
                                 **common)
        # the per-head q/k RMSNorm (one scale of head_dim each, shared by the heads), before RoPE
        norm = dict(eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype, axis_name="head_dim")
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, **norm)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, **norm)
        self.rope = rope
        self.head_dim = self.kernel_head_dim = head_dim
        self.implementation = implementation
        self.kernel = choose_impl(implementation, dtype=dtype, head_dim=head_dim)   # once, for the device present

    def __call__(self, x: jax.Array) -> jax.Array:
        """Causal self-attention over the positions 0..S-1 (packed, unpadded sequences).

        Args:
            x: [B, S, D].

        Returns:
            [B, S, D] in `dtype`.
        """
        return self.attend(*self.project(x))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The per-position part: x [B,S,D] -> q, k, v before RoPE (q and k after their norms). A block may run it
        over sequence tiles (`zoo.layers.tiles`); the tensors are named whole, by `attend`."""
        return (self.project_q(x), *self.project_kv(x))

    def project_q(self, x: jax.Array) -> jax.Array:
        """The queries before RoPE (after the q norm where there is one).

        Args:
            x: [B, S, D], the normed input.

        Returns:
            q [B, S, H, d].
        """
        q = self.q_proj(x)
        return q if self.q_norm is None else self.q_norm(q)

    def project_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The keys (before RoPE, after the k norm where there is one) and the values.

        Args:
            x: [B, S, D], the normed input.

        Returns:
            (k, v), each [B, S, Hkv, d].
        """
        k = self.k_proj(x)
        return (k if self.k_norm is None else self.k_norm(k)), self.v_proj(x)

    def named_kv(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE on the keys at positions 0..S-1, and both named.

        Args:
            k: [B, S, Hkv, d] from `project_kv`.
            v: [B, S, Hkv, d] from `project_kv`.

        Returns:
            (k after RoPE, v), named `key_proj` and `value_proj`.
        """
        k = name(self.rope(k, positions_for(k)), "key_proj", BSK)
        return k, name(v, "value_proj", BSK)

    def attend_tile(self, q: jax.Array, k: jax.Array, v: jax.Array, k_all: jax.Array, v_all: jax.Array,
                    start: jax.Array | int) -> jax.Array:
        """One query tile (`zoo.layers.query_tiles`) at positions start .. start + T - 1: RoPE on its queries, named
        `query_proj`; causal attention against its own keys and the sequence's before it
        (`zoo.layers.prefix_attention`, which names `attention_out` and `context`); the output projection, `out_proj`.

        Args:
            q: the tile's queries [B, T, H, d] from `project_q`.
            k: the tile's keys [B, T, Hkv, d] (after RoPE: `named_kv`).
            v: the tile's values [B, T, Hkv, d].
            k_all: the whole sequence's keys [B, S, Hkv, d] (after RoPE).
            v_all: the whole sequence's values [B, S, Hkv, d].
            start: the tile's first position (an int or a traced int32 scalar).

        Returns:
            [B, T, D] in `dtype`.
        """
        q = name(self.rope(q, start + positions_for(q)), "query_proj", BSH)
        out = prefix_attention(q, k, v, k_all, v_all, start, impl=self.kernel.impl)   # names attention_out, context
        return name(self.o_proj(out), "out_proj", BSD)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """RoPE on q and k, the three named, causal attention (which names its output and statistics), the output
        projection."""
        pos = positions_for(q)
        q = name(self.rope(q, pos), "query_proj", BSH)
        k = name(self.rope(k, pos), "key_proj", BSK)
        v = name(v, "value_proj", BSK)
        out = causal_attention(q, k, v, impl=self.kernel.impl)   # names attention_out and context
        return name(self.o_proj(out), "out_proj", BSD)
