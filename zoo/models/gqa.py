"""What the grouped-query attention decoders share: their config's checks and hooks (`GQAConfig`, a mixin before
the family's config base), a decoder layer's attention (`attention`) and the FLOPs per token of a dense one. Each
family declares the fields itself (`num_heads`, `num_kv_heads`, `head_dim`, `mlp_dim`, `rope_theta`, optionally
`rope_scaling`), with its published defaults."""
from __future__ import annotations

from flax import nnx

from zoo.layers import Attention, Rope
from zoo.layers.attention_kernel import causal_attention_flops
from zoo.models.fields import check_divides, check_positive, check_positive_float
from zoo.models.lm import non_embedding_params

# tp splits the heads, the kv heads and the MLP's hidden dim (zoo.sharding's rules)
MESH_DIVISORS: tuple[tuple[str, str], ...] = (("tp", "num_heads"), ("tp", "num_kv_heads"), ("tp", "mlp_dim"))


def check_gqa(cfg, *positive: str) -> None:
    """ValueError naming the field unless the heads, kv heads, head dim, MLP dim (and `positive`'s fields) are
    positive, `rope_theta` is a positive float, the kv heads divide the heads and the head dim is even (RoPE rotates
    pairs)."""
    check_positive(cfg, "num_heads", "num_kv_heads", "head_dim", "mlp_dim", *positive)
    check_positive_float(cfg, "rope_theta")
    check_divides(cfg, "num_kv_heads", "num_heads")
    if cfg.head_dim % 2:
        raise ValueError(f"{type(cfg).__name__}.head_dim must be even for RoPE, got {cfg.head_dim}")


class GQAConfig:
    """The hooks of a grouped-query-attention decoder's config (a mixin before the config base): its attention's
    head dim, the fields tp must divide, its RoPE. The fields below are declared by each family, with its defaults.

    Args:
        num_heads: the query heads H.
        num_kv_heads: the key and value heads (they divide H; Ainslie et al., 2023).
        head_dim: each head's width (even: RoPE rotates pairs).
        mlp_dim: the SwiGLU's hidden width.
        rope_theta: RoPE's base.
        rope_scaling: RoPE's frequency scaling (where the family has one).

    Examples:
        >>> from zoo.models import LlamaConfig
        >>> LlamaConfig.preset("tiny").rope().dim
        16
    """

    def check(self) -> None:
        super().check()
        check_gqa(self)

    def attention_head_dim(self) -> int:
        return self.head_dim

    def mesh_divisors(self) -> tuple[tuple[str, str], ...]:
        return MESH_DIVISORS + super().mesh_divisors()

    def rope(self) -> Rope:
        return Rope(dim=self.head_dim, theta=self.rope_theta, scaling=getattr(self, "rope_scaling", None))


def dense_flops_per_token(cfg, model: nnx.Module, seq: int) -> float:
    """A dense GQA decoder's training FLOPs per token: 6 N (forward 2N, backward 4N) plus causal attention, QK^T and
    PV over half the keys, times 3 (forward and backward)."""
    attention = 3 * causal_attention_flops(1, seq, cfg.num_heads, cfg.head_dim, cfg.head_dim) / seq * cfg.num_layers
    return 6 * non_embedding_params(model) + attention


def attention(cfg, *, rngs: nnx.Rngs, qk_norm_eps: float | None = None) -> Attention:
    """A decoder layer's grouped-query attention as `cfg` sizes it (with `qk_norm_eps`, an RMSNorm over each head of
    q and of k), in the config's dtypes, on the kernel it asks for."""
    return Attention(dim=cfg.dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     rope=cfg.rope(), implementation=cfg.attention_impl, qk_norm_eps=qk_norm_eps,
                     query_tiles=cfg.attention_tiles,
                     dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs)
