"""Multi-head latent attention (arXiv:2405.04434; the layer of arXiv:2412.19437 as published).

    q:  x -> q_a_proj -> [query_wa_proj] -> q_a_layernorm -> [mla_q] -> q_b_proj -> H x (qk_nope + qk_rope)
    kv: x -> kv_a_proj_with_mqa -> [kv_wa_proj] = (latent kv_lora_rank, shared rope key qk_rope)
           latent -> kv_a_layernorm -> [mla_kv] -> kv_b_proj -> H x (qk_nope + v_head)

RoPE (with YaRN) rotates the rope parts; q and k are [nope, rope] per head, the rope key shared by every head. Further
tags: query_proj, key_proj, value_proj, attention_out and context (the kernel's), out_proj. Parameter names and rope
layout are the published checkpoints' (docs/internals.md, "MLA").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.attention import _ChosenKernel, positions_for
from zoo.layers.attention_kernel import Implementation, causal_attention, choose_impl
from zoo.layers.linear import projection
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import Rope, YarnScaling
from zoo.sharding import BSD, BSH
from zoo.tags import name


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: interleaved pairs to rotate-half halves."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLA(_ChosenKernel):
    """Multi-head latent attention (MLA) of DeepSeek-V2 (arXiv:2405.04434) as DeepSeek-V3 publishes it
    (arXiv:2412.19437): queries and keys/values pass through low-rank latents (`q_lora_rank`, `kv_lora_rank`), each
    RMS-normalized; each head's q and k are [nope, rope] parts, the rope key shared by every head; RoPE with YaRN
    rotates the rope parts and its mscale enters the softmax scale. Parameter names are the published checkpoints'.

    Args:
        dim: the model width D.
        num_heads: the attention heads H.
        q_lora_rank: the width of the query latent.
        kv_lora_rank: the width of the key/value latent.
        qk_nope_head_dim: the per-head width of q and k without position.
        qk_rope_head_dim: the per-head width of q and k that RoPE rotates (the rope key is shared by the heads).
        v_head_dim: the per-head width of v.
        rope: the rotary embedding (`zoo.layers.Rope` of `qk_rope_head_dim` dimensions, usually with `YarnScaling`).
        rope_interleave: whether the checkpoint's rope dimensions are interleaved pairs (DeepSeek-V3's are).
        norm_eps: the eps of the two latents' RMSNorms.
        dtype: the computation's dtype.
        param_dtype: the dtype the kernels are stored in.
        implementation: the attention kernel, "xla", "cudnn" or None (chosen once, when the layer is built).
        rngs: the random generators of the kernels' initialization.

    Emits:
        `query_wa_proj` and `mla_q` (the query latent before and after its norm), `kv_wa_proj` and `mla_kv` (the
        key/value latent before and after its norm), `query_proj`, `key_proj`, `value_proj`, `attention_out`,
        `context`, `out_proj`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import MLA, Rope
        >>> mla = MLA(dim=16, num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        ...           v_head_dim=4, rope=Rope(dim=4), rngs=nnx.Rngs(0))
        >>> mla(jnp.ones((1, 6, 16))).shape
        (1, 6, 16)
        >>> list(mla.tag_shapes(batch=1, seq=6))  # doctest: +NORMALIZE_WHITESPACE
        ['query_wa_proj', 'mla_q', 'query_proj', 'kv_wa_proj', 'mla_kv', 'key_proj', 'value_proj',
         'attention_out', 'context', 'out_proj']
    """

    def __init__(self, *, dim: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, rope: Rope, rope_interleave: bool = True,
                 norm_eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32,
                 implementation: Implementation = None, rngs: nnx.Rngs):
        self.dim, self.dtype = dim, dtype
        if rope.dim != qk_rope_head_dim:
            raise ValueError(f"MLA: rope.dim={rope.dim} must equal qk_rope_head_dim={qk_rope_head_dim}")
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_a_proj = projection("bsd,dr->bsr", (dim, q_lora_rank), ("embed", "q_lora"), n_in=1, **common)
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps, dtype=dtype, param_dtype=param_dtype,
                                     axis_name="q_lora")
        self.q_b_proj = projection("bsr,rhk->bshk", (q_lora_rank, num_heads, qk_head_dim),
                                   ("q_lora", "heads", "head_dim"), n_in=1, **common)
        self.kv_a_proj_with_mqa = projection("bsd,dr->bsr", (dim, kv_lora_rank + qk_rope_head_dim),
                                             ("embed", "kv_lora"), n_in=1, **common)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps, dtype=dtype, param_dtype=param_dtype,
                                      axis_name="kv_lora")
        self.kv_b_proj = projection("bsr,rhk->bshk", (kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim),
                                    ("kv_lora", "heads", "head_dim"), n_in=1, **common)
        self.o_proj = projection("bshk,hkd->bsd", (num_heads, v_head_dim, dim), ("heads", "head_dim", "embed"),
                                 n_in=2, **common)
        self.rope = rope
        self.rope_interleave = rope_interleave
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.implementation = implementation
        self.kernel_head_dim = max(qk_head_dim, v_head_dim)  # cuDNN: values are padded to the q/k head dim
        self.kernel = choose_impl(implementation, dtype=dtype, head_dim=self.kernel_head_dim)  # once, when built
        mscale = rope.scaling.softmax_mscale() if isinstance(rope.scaling, YarnScaling) else 1.0
        self.scale = qk_head_dim ** -0.5 * mscale

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.rope(deinterleave(x) if self.rope_interleave else x, positions)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Causal self-attention over the positions 0..S-1 (packed, unpadded sequences).

        Args:
            x: [B, S, D].

        Returns:
            [B, S, D] in `dtype`.
        """
        pos = positions_for(x)
        nope = self.qk_nope_head_dim

        q_latent = name(self.q_a_proj(x), "query_wa_proj", ("batch", "seq", "q_lora"))
        q_latent = name(self.q_a_layernorm(q_latent), "mla_q", ("batch", "seq", "q_lora"))
        q = self.q_b_proj(q_latent)                                            # [B,S,H,nope+rope]
        q = name(jnp.concatenate([q[..., :nope], self._rotate(q[..., nope:], pos)], axis=-1), "query_proj", BSH)

        kv = name(self.kv_a_proj_with_mqa(x), "kv_wa_proj", ("batch", "seq", "kv_lora"))  # [B,S,kv_lora+rope]
        kv_latent, k_rope = kv[..., :self.kv_lora_rank], kv[..., self.kv_lora_rank:]
        kv_latent = name(self.kv_a_layernorm(kv_latent), "mla_kv", ("batch", "seq", "kv_lora"))
        kv_up = self.kv_b_proj(kv_latent)                                      # [B,S,H,nope+v]
        k_rope = self._rotate(k_rope[:, :, None, :], pos)                      # [B,S,1,rope], shared by heads
        k_rope = jnp.broadcast_to(k_rope, kv_up.shape[:3] + k_rope.shape[3:])
        k = name(jnp.concatenate([kv_up[..., :nope], k_rope], axis=-1), "key_proj", BSH)
        v = name(kv_up[..., nope:], "value_proj", BSH)                              # [B,S,H,v_head]

        # names attention_out [B,S,H,v_head] and context (cuDNN pads v to the q/k head dim inside, exactly)
        out = causal_attention(q, k, v, impl=self.kernel.impl, scale=self.scale)
        return name(self.o_proj(out), "out_proj", BSD)
