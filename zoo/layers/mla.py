"""Multi-head latent attention (arXiv:2405.04434; the layer of arXiv:2412.19437 as published).

Queries and keys/values pass through low-rank latents, each with an RMSNorm:

    q:  x -> q_a_proj -> [query_wa_proj] -> q_a_layernorm -> [mla_q] -> q_b_proj -> H x (qk_nope + qk_rope)
    kv: x -> kv_a_proj_with_mqa -> [kv_wa_proj] = (latent kv_lora_rank, shared rope key qk_rope)
           latent -> kv_a_layernorm -> [mla_kv] -> kv_b_proj -> H x (qk_nope + v_head)

The rope part of the key is one vector per token, shared by every head. RoPE (with YaRN) is applied to the
rope parts of q and k; q = [q_nope, q_rope] and k = [k_nope, k_rope] are concatenated per head, and attention uses
the softmax scale 1/sqrt(qk_nope + qk_rope) times YaRN's mscale^2, as the published model does.

Tags: query_wa_proj, mla_q, kv_wa_proj, mla_kv, query_proj and key_proj (after RoPE and concatenation),
value_proj [B,S,H,v_head], attention_out [B,S,H,v_head] and context [B,H,S] (named by the kernel), out_proj.

Parameter names follow the published checkpoints' attention (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj); kernels are stored [in, out] with heads split out, as everywhere in the zoo.

Rope layout. The published checkpoints store the rope columns of q_b_proj and kv_a_proj_with_mqa *interleaved*:
pairs (x0, x1), (x2, x3), ... are each rotated by one frequency (transformers' `rope_interleave=True` path,
`apply_rotary_pos_emb_interleave`). With `rope_interleave=True` (the default) this layer takes the weights as
published and de-interleaves the rope part inside the layer ([x0, x2, ...,  x1, x3, ...]) before the rotate-half
RoPE of `zoo.layers.rope`, which is exactly what transformers computes: a loader copies the weights unchanged.
The tagged query_proj / key_proj hold the rope part in the de-interleaved (rotate-half) order, as transformers'
query and key states do. With `rope_interleave=False` the weights are taken to be in rotate-half order already.

Value head dim. The published model has qk 192 and v 128; cuDNN's kernel (through `jax.nn.dot_product_attention`)
takes one head dim, so `zoo.layers.attention_kernel` pads the values with zeros for it and slices the output back:
exact, and the tags value_proj and attention_out are the un-padded [B,S,H,v_head] tensors (the XLA kernel takes
v_head as it is). Head dim 192 is within cuDNN flash attention's limit on Hopper (256). The kernel also names
`context`, its softmax statistics [B,H,S].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.attention import positions_for
from zoo.layers.attention_kernel import AttentionChoice, Implementation, causal_attention, choose_impl
from zoo.layers.linear import projection
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import Rope, YarnScaling
from zoo.layers.tagged import TaggedLayer
from zoo.sharding import BSD, BSH
from zoo.tags import name


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: interleaved pairs to rotate-half halves."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLA(TaggedLayer):
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

    def attention_choice(self, device: jax.Device | None = None) -> AttentionChoice:
        """The kernel this layer runs: chosen when it was built, for the first device (or for `device`)."""
        if device is None:
            return self.kernel
        return choose_impl(self.implementation, dtype=self.dtype, head_dim=self.kernel_head_dim, device=device)

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.rope(deinterleave(x) if self.rope_interleave else x, positions)

    def __call__(self, x: jax.Array) -> jax.Array:
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
