"""Llama 3.1 (Grattafiori et al., 2024, "The Llama 3 Herd of Models").

A pre-norm decoder: x += attention(RMSNorm(x)); x += SwiGLU(RMSNorm(x)). Grouped-query attention with
RoPE (theta 500000) and Llama 3.1's frequency scaling. The embedding and the LM head are untied.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from zoo.layers import MLP, Attention, Llama3Scaling, RMSNorm, Rope
from zoo.layers.tagged import TaggedLayer
from zoo.models.config import LMConfig, check_divides, check_positive, check_positive_float
from zoo.models.lm import CausalLM
from zoo.recipe import Recipe


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(LMConfig):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 500000.0
    rope_scaling: Llama3Scaling | None = Llama3Scaling()
    # from LMConfig: vocab_size, dim, num_layers, norm_eps (1e-5), tie_embeddings, dtype, param_dtype, attention_impl

    def check(self):
        check_positive(self, "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
        check_positive_float(self, "rope_theta")
        check_divides(self, "num_kv_heads", "num_heads")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")

    # -- presets (published sizes) ------------------------------------------------------------------------
    @classmethod
    def llama3_1_8b(cls, **overrides) -> LlamaConfig:
        return cls(**{**dict(vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             mlp_dim=14336), **overrides})

    @classmethod
    def llama3_1_70b(cls, **overrides) -> LlamaConfig:
        return cls(**{**dict(vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             mlp_dim=28672), **overrides})

    @classmethod
    def llama3_1_405b(cls, **overrides) -> LlamaConfig:
        return cls(**{**dict(vocab_size=128256, dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                             head_dim=128, mlp_dim=53248), **overrides})

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """A few layers in float32, for tests and CPU runs."""
        return cls(**{**dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             mlp_dim=128, dtype="float32", param_dtype="float32"), **overrides})

    def attention_head_dim(self) -> int:
        return self.head_dim

    def mesh_divisors(self) -> tuple[tuple[str, str], ...]:
        return (("tp", "num_heads"), ("tp", "num_kv_heads"), ("tp", "mlp_dim")) + super().mesh_divisors()

    def rope(self) -> Rope:
        return Rope(dim=self.head_dim, theta=self.rope_theta, scaling=self.rope_scaling)


class LlamaDecoderLayer(TaggedLayer):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.dim, self.dtype = cfg.dim, cfg.compute_dtype
        dtype, param_dtype = cfg.compute_dtype, cfg.weight_dtype
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.attn = Attention(dim=cfg.dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, rope=cfg.rope(), dtype=dtype, param_dtype=param_dtype,
                              implementation=cfg.attention_impl, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MLP(dim=cfg.dim, hidden=cfg.mlp_dim, dtype=dtype, param_dtype=param_dtype,
                       seq_chunks=cfg.mlp_seq_chunks, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(CausalLM):
    def __init__(self, cfg: LlamaConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, LlamaConfig):
            raise ValueError(f"Llama needs a LlamaConfig, got {type(cfg).__name__}")
        super().__init__(cfg, stacks={"layers": (lambda r: LlamaDecoderLayer(cfg, rngs=r), cfg.num_layers)},
                         recipe=recipe, rngs=rngs)


def llama3(cfg: LlamaConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Llama:
    """Build a Llama 3.1 model. `recipe` (default: `Recipe.none()`) decides each tag's placement."""
    return Llama(cfg, recipe=recipe, rngs=rngs)
